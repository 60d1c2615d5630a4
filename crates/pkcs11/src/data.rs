//! Data objects (`CKO_DATA`): an application's bytes with `CKA_LABEL`,
//! `CKA_APPLICATION`, `CKA_OBJECT_ID` and `CKA_VALUE`, all public. A
//! session object is held by the module; a token object is a vault entry of
//! kind `data` (named `dat.<random>`), its attributes encoded together, so
//! every process of the uid finds it and it is sealed with the keystore.
#![forbid(unsafe_code)]

use cryptoki_sys::*;
use memveil_asym::components;

use crate::core::as_bool;
use crate::mech::Rv;

/// Prefix of the vault names of token data objects.
pub const DATA_PREFIX: &str = "dat.";

/// The attributes of a data object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Data {
    /// `CKA_LABEL`.
    pub label: Vec<u8>,
    /// `CKA_APPLICATION`.
    pub application: Vec<u8>,
    /// `CKA_OBJECT_ID` (DER of an OID, or empty).
    pub object_id: Vec<u8>,
    /// `CKA_VALUE`.
    pub value: Vec<u8>,
}

impl Data {
    /// The bytes kept in the vault (length-prefixed fields).
    ///
    /// # Errors
    /// `CKR_ATTRIBUTE_VALUE_INVALID` past the vault's 3072 bytes.
    pub fn encode(&self) -> Result<Vec<u8>, Rv> {
        let f: [&[u8]; 4] = [&self.label, &self.application, &self.object_id, &self.value];
        let mut v = vec![0u8; components::encoded_len(&f)];
        if v.len() > components::MAX_LEN {
            return Err(CKR_ATTRIBUTE_VALUE_INVALID);
        }
        let n = components::encode_into(&f, &mut v).ok_or(CKR_ATTRIBUTE_VALUE_INVALID)?;
        v.truncate(n);
        Ok(v)
    }

    /// From the vault's bytes.
    #[must_use]
    pub fn decode(b: &[u8]) -> Option<Data> {
        match components::decode(b).ok()?[..] {
            [label, application, object_id, value] => Some(Data {
                label: label.to_vec(),
                application: application.to_vec(),
                object_id: object_id.to_vec(),
                value: value.to_vec(),
            }),
            _ => None,
        }
    }

    /// Applies one attribute of a creation or `C_SetAttributeValue`
    /// template; returns `false` for an attribute data objects do not have.
    ///
    /// # Errors
    /// `CKR_ATTRIBUTE_VALUE_INVALID` for a malformed boolean or one this
    /// module cannot honour (`CKA_PRIVATE` true: data objects are public
    /// data here); `CKR_ATTRIBUTE_READ_ONLY` after creation for every
    /// attribute but `CKA_LABEL` (PKCS#11 2.40, 4.5: no other data object
    /// attribute may be modified).
    pub fn apply(&mut self, ty: CK_ATTRIBUTE_TYPE, v: &[u8], creating: bool) -> Result<bool, Rv> {
        match ty {
            // The standard lets only the label change after creation.
            CKA_APPLICATION | CKA_OBJECT_ID | CKA_VALUE if !creating => {
                return Err(CKR_ATTRIBUTE_READ_ONLY)
            }
            CKA_LABEL => self.label = v.to_vec(),
            CKA_APPLICATION => self.application = v.to_vec(),
            CKA_OBJECT_ID => self.object_id = v.to_vec(),
            CKA_VALUE => self.value = v.to_vec(),
            CKA_CLASS | CKA_TOKEN if !creating => return Err(CKR_ATTRIBUTE_READ_ONLY),
            CKA_CLASS | CKA_TOKEN => {}
            CKA_PRIVATE => {
                if as_bool(v)? {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            CKA_MODIFIABLE | CKA_COPYABLE | CKA_DESTROYABLE => {
                // Data objects here are always modifiable and destroyable.
                if !as_bool(v)? && ty != CKA_COPYABLE {
                    return Err(CKR_ATTRIBUTE_VALUE_INVALID);
                }
            }
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// Checks a `C_CreateObject` template of class `CKO_DATA`; returns its
/// `CKA_TOKEN` and attributes.
///
/// # Errors
/// As [`Data::apply`]; `CKR_ATTRIBUTE_TYPE_INVALID` for an attribute that
/// is not a data object's.
pub fn check_data(attrs: &[(CK_ATTRIBUTE_TYPE, &[u8])]) -> Result<(bool, Data), Rv> {
    let mut d = Data::default();
    let mut token = false;
    for (ty, v) in attrs {
        if *ty == CKA_TOKEN {
            token = as_bool(v)?;
        }
        if !d.apply(*ty, v, true)? {
            return Err(CKR_ATTRIBUTE_TYPE_INVALID);
        }
    }
    d.encode()?;
    Ok((token, d))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_objects_round_trip_and_refuse_what_cannot_be_kept() {
        let d = Data {
            label: b"cfg".to_vec(),
            application: b"app".to_vec(),
            object_id: vec![6, 3, 42, 3, 4],
            value: vec![7; 100],
        };
        assert_eq!(Data::decode(&d.encode().expect("fits")), Some(d.clone()));
        let t = [CK_TRUE];
        assert_eq!(
            check_data(&[(CKA_PRIVATE, &t[..])]),
            Err(CKR_ATTRIBUTE_VALUE_INVALID)
        );
        assert_eq!(
            check_data(&[(CKA_MODULUS, &t[..])]),
            Err(CKR_ATTRIBUTE_TYPE_INVALID)
        );
        let big = vec![0u8; 4000];
        assert_eq!(
            check_data(&[(CKA_VALUE, &big[..])]),
            Err(CKR_ATTRIBUTE_VALUE_INVALID)
        );
    }
}
