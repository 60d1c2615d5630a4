//! KMIP 1.2 requests and responses over [`crate::ttlv`]: the operations
//! memveil needs (Create, Register, Get, Locate, Destroy), one batch item per
//! message. Sans-IO: requests are item trees the client encodes into secret
//! memory; responses are parsed from a decoded item.
#![forbid(unsafe_code)]

use crate::ttlv::{Item, Value};

/// KMIP tags (§9.1.3.1) used here.
#[allow(missing_docs)]
pub mod tag {
    pub const ATTRIBUTE: u32 = 0x42_0008;
    pub const ATTRIBUTE_NAME: u32 = 0x42_000A;
    pub const ATTRIBUTE_VALUE: u32 = 0x42_000B;
    pub const BATCH_COUNT: u32 = 0x42_000D;
    pub const BATCH_ITEM: u32 = 0x42_000F;
    pub const CRYPTOGRAPHIC_ALGORITHM: u32 = 0x42_0028;
    pub const CRYPTOGRAPHIC_LENGTH: u32 = 0x42_002A;
    pub const KEY: u32 = 0x42_003F;
    pub const KEY_BLOCK: u32 = 0x42_0040;
    pub const KEY_FORMAT_TYPE: u32 = 0x42_0042;
    pub const KEY_MATERIAL: u32 = 0x42_0043;
    pub const KEY_VALUE: u32 = 0x42_0045;
    pub const KEY_WRAPPING_DATA: u32 = 0x42_0046;
    pub const NAME: u32 = 0x42_0053;
    pub const NAME_TYPE: u32 = 0x42_0054;
    pub const NAME_VALUE: u32 = 0x42_0055;
    pub const OBJECT_TYPE: u32 = 0x42_0057;
    pub const OPERATION: u32 = 0x42_005C;
    pub const PROTOCOL_VERSION: u32 = 0x42_0069;
    pub const PROTOCOL_VERSION_MAJOR: u32 = 0x42_006A;
    pub const PROTOCOL_VERSION_MINOR: u32 = 0x42_006B;
    pub const REQUEST_HEADER: u32 = 0x42_0077;
    pub const REQUEST_MESSAGE: u32 = 0x42_0078;
    pub const REQUEST_PAYLOAD: u32 = 0x42_0079;
    pub const RESPONSE_HEADER: u32 = 0x42_007A;
    pub const RESPONSE_MESSAGE: u32 = 0x42_007B;
    pub const RESPONSE_PAYLOAD: u32 = 0x42_007C;
    pub const RESULT_MESSAGE: u32 = 0x42_007D;
    pub const RESULT_REASON: u32 = 0x42_007E;
    pub const RESULT_STATUS: u32 = 0x42_007F;
    pub const SECRET_DATA: u32 = 0x42_0085;
    pub const SECRET_DATA_TYPE: u32 = 0x42_0086;
    pub const SYMMETRIC_KEY: u32 = 0x42_008F;
    pub const TEMPLATE_ATTRIBUTE: u32 = 0x42_0091;
    pub const UNIQUE_IDENTIFIER: u32 = 0x42_0094;
    pub const CRYPTOGRAPHIC_USAGE_MASK: u32 = 0x42_002C;
}

/// Operations (§9.1.3.2.27).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Operation {
    /// Create a key on the server.
    Create = 0x01,
    /// Register an object the client supplies.
    Register = 0x03,
    /// Find objects by attribute.
    Locate = 0x08,
    /// Fetch an object.
    Get = 0x0A,
    /// Destroy an object.
    Destroy = 0x14,
}

impl Operation {
    /// The name the specification gives it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Create => "Create",
            Self::Register => "Register",
            Self::Locate => "Locate",
            Self::Get => "Get",
            Self::Destroy => "Destroy",
        }
    }
}

/// Object types (§9.1.3.2.12).
pub mod object_type {
    /// Symmetric Key.
    pub const SYMMETRIC_KEY: u32 = 2;
    /// Secret Data.
    pub const SECRET_DATA: u32 = 7;

    /// The specification's name of an object type.
    pub fn name(t: u32) -> &'static str {
        match t {
            1 => "Certificate",
            2 => "Symmetric Key",
            3 => "Public Key",
            4 => "Private Key",
            5 => "Split Key",
            6 => "Template",
            7 => "Secret Data",
            8 => "Opaque Object",
            9 => "PGP Key",
            _ => "unknown object type",
        }
    }
}

/// Result reasons (§9.1.3.2.29) worth naming.
pub mod reason {
    /// Item Not Found.
    pub const ITEM_NOT_FOUND: u32 = 0x01;
    /// Permission Denied.
    pub const PERMISSION_DENIED: u32 = 0x0C;

    /// The specification's name of a result reason.
    pub fn name(r: u32) -> &'static str {
        match r {
            0x01 => "Item Not Found",
            0x02 => "Response Too Large",
            0x03 => "Authentication Not Successful",
            0x04 => "Invalid Message",
            0x05 => "Operation Not Supported",
            0x06 => "Missing Data",
            0x07 => "Invalid Field",
            0x08 => "Feature Not Supported",
            0x0A => "Cryptographic Failure",
            0x0B => "Illegal Operation",
            0x0C => "Permission Denied",
            0x0D => "Object Archived",
            0x100 => "General Failure",
            _ => "unknown reason",
        }
    }
}

const AES: u32 = 3;
const RAW: u32 = 1;
const OPAQUE: u32 = 2;
const TRANSPARENT_SYMMETRIC: u32 = 7;
/// Cryptographic Usage Mask: Encrypt | Decrypt | Wrap Key | Unwrap Key.
const USAGE: i32 = 0x04 | 0x08 | 0x10 | 0x20;

fn e(tag: u32, v: u32) -> Item<'static> {
    Item::new(tag, Value::Enumeration(v))
}

fn i(tag: u32, v: i32) -> Item<'static> {
    Item::new(tag, Value::Integer(v))
}

fn attr<'a>(name: &'static str, value: Item<'a>) -> Item<'a> {
    Item::structure(
        tag::ATTRIBUTE,
        vec![
            Item::new(tag::ATTRIBUTE_NAME, Value::Text(name)),
            Item {
                tag: tag::ATTRIBUTE_VALUE,
                ..value
            },
        ],
    )
}

fn name_attr(name: &str) -> Item<'_> {
    attr(
        "Name",
        Item::structure(
            0,
            vec![
                Item::new(tag::NAME_VALUE, Value::Text(name)),
                // Uninterpreted Text String.
                e(tag::NAME_TYPE, 1),
            ],
        ),
    )
}

/// The attributes of an AES key of `bits` bits, named `name`, under the
/// operation policy `policy` (server-side access rules; `None`: the server's
/// default, usually owner-only).
fn aes_attrs<'a>(bits: i32, name: Option<&'a str>, policy: Option<&'a str>) -> Item<'a> {
    let mut v = vec![
        attr("Cryptographic Algorithm", e(0, AES)),
        attr("Cryptographic Length", i(0, bits)),
        attr("Cryptographic Usage Mask", i(0, USAGE)),
    ];
    if let Some(n) = name {
        v.push(name_attr(n));
    }
    if let Some(p) = policy {
        v.push(attr("Operation Policy Name", Item::new(0, Value::Text(p))));
    }
    Item::structure(tag::TEMPLATE_ATTRIBUTE, v)
}

/// A request message of one batch item.
pub fn request(op: Operation, payload: Vec<Item<'_>>) -> Item<'_> {
    Item::structure(
        tag::REQUEST_MESSAGE,
        vec![
            Item::structure(
                tag::REQUEST_HEADER,
                vec![
                    Item::structure(
                        tag::PROTOCOL_VERSION,
                        vec![
                            i(tag::PROTOCOL_VERSION_MAJOR, 1),
                            i(tag::PROTOCOL_VERSION_MINOR, 2),
                        ],
                    ),
                    i(tag::BATCH_COUNT, 1),
                ],
            ),
            Item::structure(
                tag::BATCH_ITEM,
                vec![
                    e(tag::OPERATION, op as u32),
                    Item::structure(tag::REQUEST_PAYLOAD, payload),
                ],
            ),
        ],
    )
}

/// Create: an AES key of `bits` bits made by the server.
pub fn create_aes<'a>(bits: i32, name: Option<&'a str>, policy: Option<&'a str>) -> Item<'a> {
    request(
        Operation::Create,
        vec![
            e(tag::OBJECT_TYPE, object_type::SYMMETRIC_KEY),
            aes_attrs(bits, name, policy),
        ],
    )
}

/// Register: `key` as a raw AES symmetric key. `key` should live in secret
/// memory; the encoded request is built there too.
pub fn register_aes<'a>(key: &'a [u8], name: Option<&'a str>, policy: Option<&'a str>) -> Item<'a> {
    let bits = i32::try_from(key.len().saturating_mul(8)).unwrap_or(i32::MAX);
    request(
        Operation::Register,
        vec![
            e(tag::OBJECT_TYPE, object_type::SYMMETRIC_KEY),
            aes_attrs(bits, name, policy),
            Item::structure(
                tag::SYMMETRIC_KEY,
                vec![Item::structure(
                    tag::KEY_BLOCK,
                    vec![
                        e(tag::KEY_FORMAT_TYPE, RAW),
                        Item::structure(
                            tag::KEY_VALUE,
                            vec![Item::new(tag::KEY_MATERIAL, Value::Bytes(key))],
                        ),
                        e(tag::CRYPTOGRAPHIC_ALGORITHM, AES),
                        i(tag::CRYPTOGRAPHIC_LENGTH, bits),
                    ],
                )],
            ),
        ],
    )
}

/// Register: `data` as Secret Data (type Seed, Opaque key format): bytes
/// the server keeps and returns as they are (memveil's wrapped backups).
pub fn register_secret<'a>(
    data: &'a [u8],
    name: Option<&'a str>,
    policy: Option<&'a str>,
) -> Item<'a> {
    let mut attrs = vec![attr("Cryptographic Usage Mask", i(0, 0x10 | 0x20))];
    if let Some(n) = name {
        attrs.push(name_attr(n));
    }
    if let Some(p) = policy {
        attrs.push(attr("Operation Policy Name", Item::new(0, Value::Text(p))));
    }
    request(
        Operation::Register,
        vec![
            e(tag::OBJECT_TYPE, object_type::SECRET_DATA),
            Item::structure(tag::TEMPLATE_ATTRIBUTE, attrs),
            Item::structure(
                tag::SECRET_DATA,
                vec![
                    // Seed.
                    e(tag::SECRET_DATA_TYPE, 2),
                    Item::structure(
                        tag::KEY_BLOCK,
                        vec![
                            e(tag::KEY_FORMAT_TYPE, OPAQUE),
                            Item::structure(
                                tag::KEY_VALUE,
                                vec![Item::new(tag::KEY_MATERIAL, Value::Bytes(data))],
                            ),
                        ],
                    ),
                ],
            ),
        ],
    )
}

/// An operation on one object by its Unique Identifier (Get, Destroy).
pub fn by_uid(op: Operation, uid: &str) -> Item<'_> {
    request(
        op,
        vec![Item::new(tag::UNIQUE_IDENTIFIER, Value::Text(uid))],
    )
}

/// Locate: objects whose Name is `name`.
pub fn locate_name(name: &str) -> Item<'_> {
    request(Operation::Locate, vec![name_attr(name)])
}

/// How a response failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// Not a well-formed response of the operation asked for.
    Malformed(String),
    /// The server answered with a result status other than Success.
    Refused {
        /// Result Reason (0 when absent).
        reason: u32,
        /// Result Message, if any.
        message: String,
    },
}

/// Checks a response message to `op` and returns its payload (an empty
/// structure when the server sent none).
///
/// # Errors
/// [`Failure`]: malformed, or the server's refusal with its reason.
pub fn response<'a, 'b>(msg: &'b Item<'a>, op: Operation) -> Result<&'b Item<'a>, Failure> {
    let bad = |w: &str| Failure::Malformed(w.to_owned());
    if msg.tag != tag::RESPONSE_MESSAGE {
        return Err(bad("not a Response Message"));
    }
    msg.child(tag::RESPONSE_HEADER)
        .ok_or_else(|| bad("no Response Header"))?;
    let mut items = msg.all(tag::BATCH_ITEM);
    let item = items.next().ok_or_else(|| bad("no Batch Item"))?;
    if items.next().is_some() {
        return Err(bad("more than one Batch Item"));
    }
    let status = item
        .child(tag::RESULT_STATUS)
        .and_then(Item::enumeration)
        .ok_or_else(|| bad("no Result Status"))?;
    if status != 0 {
        return Err(Failure::Refused {
            reason: item
                .child(tag::RESULT_REASON)
                .and_then(Item::enumeration)
                .unwrap_or(0),
            message: item
                .child(tag::RESULT_MESSAGE)
                .and_then(Item::text)
                .unwrap_or_default()
                .to_owned(),
        });
    }
    if let Some(o) = item.child(tag::OPERATION).and_then(Item::enumeration) {
        if o != op as u32 {
            return Err(bad("the answer is to another operation"));
        }
    }
    static EMPTY: Item<'static> = Item {
        tag: tag::RESPONSE_PAYLOAD,
        value: Value::Structure(Vec::new()),
    };
    Ok(item.child(tag::RESPONSE_PAYLOAD).unwrap_or(&EMPTY))
}

/// The Unique Identifier in a payload.
///
/// # Errors
/// [`Failure::Malformed`] when it is missing.
pub fn uid<'a>(payload: &Item<'a>) -> Result<&'a str, Failure> {
    payload
        .child(tag::UNIQUE_IDENTIFIER)
        .and_then(Item::text)
        .ok_or_else(|| Failure::Malformed("no Unique Identifier".into()))
}

/// What a Get returned.
pub enum Got<'a> {
    /// A symmetric key's (or secret data's) raw bytes.
    Key {
        /// The object type (2 symmetric key, 7 secret data).
        object_type: u32,
        /// The bytes (borrowed from the decoded response).
        material: &'a [u8],
    },
    /// Some other object type (certificate, public key, ...).
    OtherType(u32),
    /// A key the server returned wrapped (Key Wrapping Data present).
    Wrapped,
}

/// The key material of a Get payload.
///
/// # Errors
/// [`Failure::Malformed`] for a payload without the fields a key has.
pub fn got<'a>(payload: &Item<'a>) -> Result<Got<'a>, Failure> {
    let bad = |w: &str| Failure::Malformed(w.to_owned());
    let ot = payload
        .child(tag::OBJECT_TYPE)
        .and_then(Item::enumeration)
        .ok_or_else(|| bad("Get answer without Object Type"))?;
    let obj_tag = match ot {
        object_type::SYMMETRIC_KEY => tag::SYMMETRIC_KEY,
        object_type::SECRET_DATA => tag::SECRET_DATA,
        other => return Ok(Got::OtherType(other)),
    };
    let block = payload
        .child(obj_tag)
        .and_then(|o| o.child(tag::KEY_BLOCK))
        .ok_or_else(|| bad("Get answer without Key Block"))?;
    if block.child(tag::KEY_WRAPPING_DATA).is_some() {
        return Ok(Got::Wrapped);
    }
    let format = block
        .child(tag::KEY_FORMAT_TYPE)
        .and_then(Item::enumeration)
        .ok_or_else(|| bad("Key Block without Key Format Type"))?;
    let km = block
        .child(tag::KEY_VALUE)
        .and_then(|v| v.child(tag::KEY_MATERIAL))
        .ok_or_else(|| bad("Key Block without Key Material"))?;
    let material = match format {
        RAW | OPAQUE => km.bytes(),
        TRANSPARENT_SYMMETRIC => km.child(tag::KEY).and_then(Item::bytes),
        _ => {
            return Err(bad(
                "Key Format Type is neither Raw nor Transparent Symmetric Key",
            ))
        }
    }
    .ok_or_else(|| bad("Key Material is not a byte string"))?;
    Ok(Got::Key {
        object_type: ot,
        material,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ttlv::decode;

    fn answer<'a>(op: Operation, status: u32, payload: Vec<Item<'a>>) -> Item<'a> {
        let mut bi = vec![e(tag::OPERATION, op as u32), e(tag::RESULT_STATUS, status)];
        if status != 0 {
            bi.push(e(tag::RESULT_REASON, reason::ITEM_NOT_FOUND));
            bi.push(Item::new(
                tag::RESULT_MESSAGE,
                Value::Text("no such object"),
            ));
        } else {
            bi.push(Item::structure(tag::RESPONSE_PAYLOAD, payload));
        }
        Item::structure(
            tag::RESPONSE_MESSAGE,
            vec![
                Item::structure(tag::RESPONSE_HEADER, vec![i(tag::BATCH_COUNT, 1)]),
                Item::structure(tag::BATCH_ITEM, bi),
            ],
        )
    }

    #[test]
    fn get_answer_gives_the_key_bytes() {
        let key = [7u8; 32];
        // The server's answer carries the same object a Register sends.
        let reg = register_aes(&key, None, None);
        let obj = reg.children()[1]
            .child(tag::REQUEST_PAYLOAD)
            .expect("payload")
            .children()[2]
            .clone();
        let a = answer(
            Operation::Get,
            0,
            vec![
                e(tag::OBJECT_TYPE, object_type::SYMMETRIC_KEY),
                Item::new(tag::UNIQUE_IDENTIFIER, Value::Text("1")),
                obj,
            ],
        );
        let bytes = a.to_vec();
        let m = decode(&bytes).expect("decode");
        let p = response(&m, Operation::Get).expect("success");
        assert_eq!(uid(p), Ok("1"));
        match got(p).expect("got") {
            Got::Key {
                object_type,
                material,
            } => {
                assert_eq!(object_type, 2);
                assert_eq!(material, &key);
            }
            _ => panic!("not a key"),
        }
    }

    #[test]
    fn refusal_and_wrong_answers() {
        let a = answer(Operation::Get, 1, vec![]).to_vec();
        let m = decode(&a).expect("decode");
        assert_eq!(
            response(&m, Operation::Get).err(),
            Some(Failure::Refused {
                reason: reason::ITEM_NOT_FOUND,
                message: "no such object".into()
            })
        );
        let a = answer(Operation::Get, 0, vec![]).to_vec();
        let m = decode(&a).expect("decode");
        assert!(matches!(
            response(&m, Operation::Create),
            Err(Failure::Malformed(_))
        ));
        let p = response(&m, Operation::Get).expect("ok");
        assert!(matches!(got(p), Err(Failure::Malformed(_))));
        let cert = answer(Operation::Get, 0, vec![e(tag::OBJECT_TYPE, 1)]).to_vec();
        let m = decode(&cert).expect("decode");
        let p = response(&m, Operation::Get).expect("ok");
        assert!(matches!(got(p), Ok(Got::OtherType(1))));
    }

    #[test]
    fn create_request_layout() {
        // Starts as KMIP 1.2's Create use case: Request Message, header, version 1.2.
        let b = create_aes(256, Some("n"), None).to_vec();
        assert_eq!(&b[..4], &[0x42, 0x00, 0x78, 0x01]);
        assert_eq!(hex::encode(&b[8..16]), "4200770100000038");
        let m = decode(&b).expect("decode");
        let bi = m.child(tag::BATCH_ITEM).expect("batch item");
        assert_eq!(
            bi.child(tag::OPERATION).and_then(Item::enumeration),
            Some(1)
        );
    }
}
