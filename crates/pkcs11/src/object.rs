//! The token's objects: what a vault key looks like through PKCS#11.
//!
//! An AES key is one secret-key object. An asymmetric key is two objects
//! with the same label and id: its private key (sensitive, never
//! extractable: every private attribute answers `CKR_ATTRIBUTE_SENSITIVE`)
//! and its public key (modulus and exponent, or curve and point). A
//! certificate (a vault entry of kind `cert`) is a certificate object.
#![forbid(unsafe_code)]

use std::sync::Arc;

use cryptoki_sys::*;
use memveil_asym::{Curve, Public};
use memveil_vault::keyfile;
use memveil_vault::proto::{KeyKind, PublicParts};

use crate::mech::Rv;

/// Prefix of the vault names of session objects: `p11s.<pid>.<n>`.
pub const SESSION_PREFIX: &str = "p11s.";
/// Prefix of the vault names of certificates (`crt.<label>..<id>`), which
/// share their label and id with the key they certify.
pub const CERT_PREFIX: &str = "crt.";

/// Indexes into [`Obj::caps`].
pub mod cap {
    /// `CKA_ENCRYPT`.
    pub const ENCRYPT: usize = 0;
    /// `CKA_DECRYPT`.
    pub const DECRYPT: usize = 1;
    /// `CKA_SIGN`.
    pub const SIGN: usize = 2;
    /// `CKA_VERIFY`.
    pub const VERIFY: usize = 3;
    /// `CKA_DERIVE`.
    pub const DERIVE: usize = 4;
}

/// A vault entry as a PKCS#11 object.
#[derive(Debug, Clone)]
pub struct Obj {
    /// Vault key id.
    pub vault_id: u32,
    /// Vault key name.
    pub name: String,
    /// The vault kind.
    pub kind: KeyKind,
    /// `CKA_CLASS`: `CKO_SECRET_KEY`, `CKO_PRIVATE_KEY`, `CKO_PUBLIC_KEY`
    /// or `CKO_CERTIFICATE`.
    pub class: CK_OBJECT_CLASS,
    /// `CKA_LABEL`.
    pub label: Vec<u8>,
    /// `CKA_ID`.
    pub id: Vec<u8>,
    /// `CKA_TOKEN`.
    pub token: bool,
    /// The session that owns a session object (0 for token objects).
    pub session: CK_SESSION_HANDLE,
    /// Generated inside the vault by this module (`CKA_LOCAL`).
    pub local: bool,
    /// `CKA_ENCRYPT`, `CKA_DECRYPT`, `CKA_SIGN`, `CKA_VERIFY`, `CKA_DERIVE`
    /// (indexes in [`cap`]).
    pub caps: [bool; 5],
    /// The public half (asymmetric keys) or the DER (certificates).
    pub public: Option<Arc<PublicParts>>,
}

fn ck_bool(b: bool) -> Vec<u8> {
    vec![if b { CK_TRUE } else { CK_FALSE }]
}

fn ck_ulong(v: CK_ULONG) -> Vec<u8> {
    v.to_ne_bytes().to_vec()
}

/// What `C_GetAttributeValue` finds for one attribute.
#[derive(Debug, PartialEq, Eq)]
pub enum Attr {
    /// The value's bytes.
    Value(Vec<u8>),
    /// A private value: never leaves the vault.
    Sensitive,
    /// Not an attribute of this object.
    Invalid,
}

/// `CKA_KEY_TYPE` of a vault kind.
#[must_use]
pub fn key_type(kind: KeyKind) -> CK_KEY_TYPE {
    match kind {
        KeyKind::Rsa2048 | KeyKind::Rsa3072 | KeyKind::Rsa4096 => CKK_RSA,
        KeyKind::P256 | KeyKind::P384 => CKK_EC,
        KeyKind::Ed25519 => CKK_EC_EDWARDS,
        KeyKind::Secret => CKK_GENERIC_SECRET,
        _ => CKK_AES,
    }
}

/// The DER of Ed25519's curve identifier (OID 1.3.101.112), as
/// `CKA_EC_PARAMS` of an `CKK_EC_EDWARDS` key.
pub const ED25519_PARAMS: &[u8] = &[0x06, 0x03, 0x2b, 0x65, 0x70];

/// `CKA_EC_PARAMS` of a curve.
#[must_use]
pub fn ec_params(c: Curve) -> &'static [u8] {
    c.oid_der()
}

impl Obj {
    fn public_key(&self) -> Option<&Public> {
        match self.public.as_deref() {
            Some(PublicParts::Key(p)) => Some(p),
            _ => None,
        }
    }

    /// One attribute.
    #[must_use]
    pub fn attr(&self, t: CK_ATTRIBUTE_TYPE) -> Attr {
        let common = match t {
            CKA_CLASS => Some(ck_ulong(self.class)),
            CKA_LABEL => Some(self.label.clone()),
            CKA_ID => Some(self.id.clone()),
            CKA_TOKEN => Some(ck_bool(self.token)),
            CKA_PRIVATE | CKA_COPYABLE => Some(ck_bool(false)),
            CKA_MODIFIABLE => Some(ck_bool(self.class == CKO_DATA)),
            CKA_DESTROYABLE => Some(ck_bool(true)),
            _ => None,
        };
        if let Some(v) = common {
            return Attr::Value(v);
        }
        match self.class {
            CKO_SECRET_KEY => self.secret_attr(t),
            CKO_CERTIFICATE => self.cert_attr(t),
            CKO_DATA => self.data_attr(t),
            _ => self.pair_attr(t),
        }
    }

    fn key_common(&self, t: CK_ATTRIBUTE_TYPE, gen: CK_MECHANISM_TYPE) -> Option<Attr> {
        Some(Attr::Value(match t {
            CKA_KEY_TYPE => ck_ulong(key_type(self.kind)),
            CKA_LOCAL => ck_bool(self.local),
            CKA_KEY_GEN_MECHANISM => ck_ulong(if self.local {
                gen
            } else {
                CK_UNAVAILABLE_INFORMATION
            }),
            CKA_START_DATE | CKA_END_DATE => Vec::new(),
            CKA_DERIVE => ck_bool(self.caps[cap::DERIVE]),
            _ => return None,
        }))
    }

    fn secret_attr(&self, t: CK_ATTRIBUTE_TYPE) -> Attr {
        let gen = if self.kind == KeyKind::Secret {
            CKM_GENERIC_SECRET_KEY_GEN
        } else {
            CKM_AES_KEY_GEN
        };
        if let Some(a) = self.key_common(t, gen) {
            return a;
        }
        let v = match t {
            CKA_VALUE_LEN => ck_ulong(match self.public.as_deref() {
                Some(PublicParts::SecretLen(n)) => CK_ULONG::from(*n),
                _ => self.kind.key_len() as CK_ULONG,
            }),
            CKA_EXTRACTABLE
            | CKA_WRAP
            | CKA_UNWRAP
            | CKA_TRUSTED
            | CKA_WRAP_WITH_TRUSTED
            | CKA_ALWAYS_AUTHENTICATE => ck_bool(false),
            CKA_SENSITIVE | CKA_NEVER_EXTRACTABLE => ck_bool(true),
            CKA_ALWAYS_SENSITIVE => ck_bool(self.local),
            CKA_ENCRYPT => ck_bool(self.caps[cap::ENCRYPT]),
            CKA_DECRYPT => ck_bool(self.caps[cap::DECRYPT]),
            CKA_SIGN => ck_bool(self.caps[cap::SIGN]),
            CKA_VERIFY => ck_bool(self.caps[cap::VERIFY]),
            CKA_VALUE => return Attr::Sensitive,
            _ => return Attr::Invalid,
        };
        Attr::Value(v)
    }

    fn pair_attr(&self, t: CK_ATTRIBUTE_TYPE) -> Attr {
        let gen = match key_type(self.kind) {
            CKK_RSA => CKM_RSA_PKCS_KEY_PAIR_GEN,
            CKK_EC => CKM_EC_KEY_PAIR_GEN,
            _ => CKM_EC_EDWARDS_KEY_PAIR_GEN,
        };
        if let Some(a) = self.key_common(t, gen) {
            return a;
        }
        let private = self.class == CKO_PRIVATE_KEY;
        let Some(p) = self.public_key() else {
            return Attr::Invalid;
        };
        let v = match (t, p) {
            (CKA_SUBJECT, _) => Vec::new(),
            (CKA_PUBLIC_KEY_INFO, p) => keyfile::spki_der(p),
            (CKA_MODULUS, Public::Rsa { n, .. }) => n.clone(),
            (CKA_PUBLIC_EXPONENT, Public::Rsa { e, .. }) => e.clone(),
            (CKA_MODULUS_BITS, Public::Rsa { n, .. }) => ck_ulong(keyfile::rsa_bits(n) as CK_ULONG),
            (CKA_EC_PARAMS, Public::Ec { curve, .. }) => ec_params(*curve).to_vec(),
            (CKA_EC_PARAMS, Public::Ed25519(_)) => ED25519_PARAMS.to_vec(),
            (CKA_EC_POINT, Public::Ec { point, .. }) => keyfile::der(0x04, point),
            (CKA_EC_POINT, Public::Ed25519(pk)) => keyfile::der(0x04, pk),
            (
                CKA_PRIVATE_EXPONENT | CKA_PRIME_1 | CKA_PRIME_2 | CKA_EXPONENT_1 | CKA_EXPONENT_2
                | CKA_COEFFICIENT,
                Public::Rsa { .. },
            )
            | (CKA_VALUE, Public::Ec { .. } | Public::Ed25519(_))
                if private =>
            {
                return Attr::Sensitive
            }
            (CKA_SENSITIVE | CKA_NEVER_EXTRACTABLE, _) if private => ck_bool(true),
            (CKA_ALWAYS_SENSITIVE, _) if private => ck_bool(self.local),
            (CKA_EXTRACTABLE | CKA_UNWRAP | CKA_SIGN_RECOVER | CKA_WRAP_WITH_TRUSTED, _)
                if private =>
            {
                ck_bool(false)
            }
            (CKA_ALWAYS_AUTHENTICATE, _) if private => ck_bool(false),
            (CKA_SIGN, _) if private => ck_bool(self.caps[cap::SIGN]),
            (CKA_DECRYPT, _) if private => ck_bool(self.caps[cap::DECRYPT]),
            // The public half verifies (and encrypts, RSA) in this process.
            (CKA_ENCRYPT, _) if !private => ck_bool(self.caps[cap::ENCRYPT]),
            (CKA_VERIFY, _) if !private => ck_bool(self.caps[cap::VERIFY]),
            (CKA_VERIFY_RECOVER, p) if !private => {
                ck_bool(self.caps[cap::VERIFY] && matches!(p, Public::Rsa { .. }))
            }
            (CKA_WRAP | CKA_TRUSTED, _) if !private => ck_bool(false),
            _ => return Attr::Invalid,
        };
        Attr::Value(v)
    }

    fn data_attr(&self, t: CK_ATTRIBUTE_TYPE) -> Attr {
        let Some(d) = self.data() else {
            return Attr::Invalid;
        };
        Attr::Value(match t {
            CKA_APPLICATION => d.application,
            CKA_OBJECT_ID => d.object_id,
            CKA_VALUE => d.value,
            _ => return Attr::Invalid,
        })
    }

    /// A data object's attributes.
    #[must_use]
    pub fn data(&self) -> Option<crate::data::Data> {
        match self.public.as_deref() {
            Some(PublicParts::Data(b)) => crate::data::Data::decode(b),
            _ => None,
        }
    }

    fn cert_attr(&self, t: CK_ATTRIBUTE_TYPE) -> Attr {
        let der: &[u8] = match self.public.as_deref() {
            Some(PublicParts::Cert(d)) => d,
            _ => return Attr::Invalid,
        };
        let f = keyfile::cert_fields(der).ok();
        let v = match t {
            CKA_CERTIFICATE_TYPE => ck_ulong(CKC_X_509),
            CKA_TRUSTED => ck_bool(false),
            CKA_CERTIFICATE_CATEGORY => ck_ulong(0),
            CKA_VALUE => der.to_vec(),
            CKA_SUBJECT => f.map(|f| f.subject.to_vec()).unwrap_or_default(),
            CKA_ISSUER => f.map(|f| f.issuer.to_vec()).unwrap_or_default(),
            CKA_SERIAL_NUMBER => f.map(|f| f.serial.to_vec()).unwrap_or_default(),
            CKA_PUBLIC_KEY_INFO => f.map(|f| f.spki.to_vec()).unwrap_or_default(),
            CKA_START_DATE
            | CKA_END_DATE
            | CKA_URL
            | CKA_HASH_OF_SUBJECT_PUBLIC_KEY
            | CKA_HASH_OF_ISSUER_PUBLIC_KEY => Vec::new(),
            _ => return Attr::Invalid,
        };
        Attr::Value(v)
    }
}

/// The `CKA_ID` of a key pair whose vault name carries none: SHA-1 of the
/// public modulus, EC point or Ed25519 key (OpenSC's convention). Clients
/// such as OpenSSH find a private key by the id of its public key; without
/// one, every key pair would share the empty id.
#[must_use]
pub fn default_id(p: &PublicParts) -> Vec<u8> {
    use memveil_asym::{hash::digest, Hash};
    match p {
        PublicParts::Key(Public::Rsa { n, .. }) => digest(Hash::Sha1, n),
        PublicParts::Key(Public::Ec { point, .. }) => digest(Hash::Sha1, point),
        PublicParts::Key(Public::Ed25519(pk)) => digest(Hash::Sha1, pk),
        PublicParts::Cert(_) | PublicParts::SecretLen(_) | PublicParts::Data(_) => Vec::new(),
    }
}

/// The vault name of a token object with `label` and `id`:
/// `label` alone, or `label..hex(id)` (`..` cannot appear in a label).
///
/// # Errors
/// `CKR_ATTRIBUTE_VALUE_INVALID` when the label has characters outside
/// `[A-Za-z0-9._-]`, contains `..`, or the name would pass 64 characters.
pub fn token_name(label: &[u8], id: &[u8]) -> Result<String, Rv> {
    let label = std::str::from_utf8(label).map_err(|_| CKR_ATTRIBUTE_VALUE_INVALID)?;
    if label.contains("..") || label.starts_with(SESSION_PREFIX) || label.starts_with(CERT_PREFIX) {
        return Err(CKR_ATTRIBUTE_VALUE_INVALID);
    }
    let name = if id.is_empty() {
        label.to_owned()
    } else {
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        format!("{label}..{hex}")
    };
    if memveil_vault::proto::valid_name(&name) {
        Ok(name)
    } else {
        Err(CKR_ATTRIBUTE_VALUE_INVALID)
    }
}

/// Label and id back from a vault name (see [`token_name`]); a
/// certificate's name loses its [`CERT_PREFIX`].
#[must_use]
pub fn parse_name(name: &str, kind: KeyKind) -> (Vec<u8>, Vec<u8>) {
    let name = if kind == KeyKind::Cert {
        name.strip_prefix(CERT_PREFIX).unwrap_or(name)
    } else {
        name
    };
    if let Some((label, hex)) = name.rsplit_once("..") {
        if !hex.is_empty() && hex.len() % 2 == 0 && !label.contains("..") {
            let id: Option<Vec<u8>> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(hex.get(i..i + 2)?, 16).ok())
                .collect();
            if let Some(id) = id {
                return (label.as_bytes().to_vec(), id);
            }
        }
    }
    (name.as_bytes().to_vec(), Vec::new())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_carry_label_and_id_both_ways() {
        let n = token_name(b"disk0", &[0x01, 0xab]).expect("name");
        assert_eq!(n, "disk0..01ab");
        assert_eq!(
            parse_name(&n, KeyKind::Aes128),
            (b"disk0".to_vec(), vec![0x01, 0xab])
        );
        assert_eq!(
            parse_name("plain", KeyKind::Aes128),
            (b"plain".to_vec(), vec![])
        );
        assert_eq!(
            parse_name("crt.srv..01", KeyKind::Cert),
            (b"srv".to_vec(), vec![1])
        );
        assert_eq!(token_name(b"a..b", &[]), Err(CKR_ATTRIBUTE_VALUE_INVALID));
        assert_eq!(token_name(b"crt.x", &[]), Err(CKR_ATTRIBUTE_VALUE_INVALID));
        assert_eq!(token_name(b"sp ace", &[]), Err(CKR_ATTRIBUTE_VALUE_INVALID));
        assert_eq!(
            token_name(&[b'x'; 60], &[1, 2, 3]),
            Err(CKR_ATTRIBUTE_VALUE_INVALID)
        );
    }

    #[test]
    fn private_parts_are_sensitive_and_public_parts_readable() {
        let n = vec![0xc1; 256];
        let o = Obj {
            vault_id: 1,
            name: "k".into(),
            kind: KeyKind::Rsa2048,
            class: CKO_PRIVATE_KEY,
            label: b"k".to_vec(),
            id: vec![1],
            token: true,
            session: 0,
            local: true,
            caps: [false, true, true, false, false],
            public: Some(Arc::new(PublicParts::Key(Public::Rsa {
                n: n.clone(),
                e: vec![1, 0, 1],
            }))),
        };
        for t in [
            CKA_PRIVATE_EXPONENT,
            CKA_PRIME_1,
            CKA_PRIME_2,
            CKA_COEFFICIENT,
        ] {
            assert_eq!(o.attr(t), Attr::Sensitive);
        }
        assert_eq!(o.attr(CKA_MODULUS), Attr::Value(n.clone()));
        assert_eq!(o.attr(CKA_EXTRACTABLE), Attr::Value(vec![CK_FALSE]));
        assert_eq!(o.attr(CKA_SENSITIVE), Attr::Value(vec![CK_TRUE]));
        let p = Obj {
            class: CKO_PUBLIC_KEY,
            ..o.clone()
        };
        assert_eq!(p.attr(CKA_PRIVATE_EXPONENT), Attr::Invalid);
        assert_eq!(
            p.attr(CKA_MODULUS_BITS),
            Attr::Value((2048 as CK_ULONG).to_ne_bytes().to_vec())
        );
        assert_eq!(p.attr(CKA_DESTROYABLE), Attr::Value(vec![CK_TRUE]));
    }
}
