//! TTLV, KMIP's encoding (KMIP 1.x specification §9.1): each item is a 3-byte
//! tag, a 1-byte type, a 4-byte big-endian length and the value, padded with
//! zeros to a multiple of 8 bytes. Sans-IO: bytes in, items out; items out,
//! bytes in a caller's buffer (secret memory when the item carries key bytes).
//!
//! The decoder borrows: byte and text strings are slices of the input, so key
//! material read into secret memory is never copied by decoding. It refuses,
//! without panicking, anything that is not well formed: a length past the end,
//! a fixed-size type with another length, a structure whose items do not fill
//! it exactly, a text string that is not UTF-8, nesting deeper than
//! [`MAX_DEPTH`], an unknown type.
#![forbid(unsafe_code)]

/// Deepest nesting of structures the decoder accepts (KMIP messages need 8).
pub const MAX_DEPTH: usize = 16;

/// TTLV item types (§9.1.1.2).
pub mod typ {
    /// Structure.
    pub const STRUCTURE: u8 = 0x01;
    /// 32-bit signed integer.
    pub const INTEGER: u8 = 0x02;
    /// 64-bit signed integer.
    pub const LONG_INTEGER: u8 = 0x03;
    /// Big-endian two's complement, a multiple of 8 bytes.
    pub const BIG_INTEGER: u8 = 0x04;
    /// 32-bit unsigned enumeration.
    pub const ENUMERATION: u8 = 0x05;
    /// 64-bit boolean.
    pub const BOOLEAN: u8 = 0x06;
    /// UTF-8 text.
    pub const TEXT_STRING: u8 = 0x07;
    /// Bytes.
    pub const BYTE_STRING: u8 = 0x08;
    /// Seconds since the epoch, 64-bit.
    pub const DATE_TIME: u8 = 0x09;
    /// Seconds, 32-bit unsigned.
    pub const INTERVAL: u8 = 0x0A;
}

/// A decoded (or to-be-encoded) value.
#[derive(Clone, PartialEq, Eq)]
pub enum Value<'a> {
    /// Items in order.
    Structure(Vec<Item<'a>>),
    /// Integer.
    Integer(i32),
    /// Long Integer.
    LongInteger(i64),
    /// Big Integer, as its big-endian bytes (a multiple of 8).
    BigInteger(&'a [u8]),
    /// Enumeration.
    Enumeration(u32),
    /// Boolean.
    Boolean(bool),
    /// Text String.
    Text(&'a str),
    /// Byte String.
    Bytes(&'a [u8]),
    /// Date-Time (seconds since 1970).
    DateTime(i64),
    /// Interval (seconds).
    Interval(u32),
}

/// One TTLV item: a tag (24 bits, `0x42xxxx` for KMIP's own) and its value.
#[derive(Clone, PartialEq, Eq)]
pub struct Item<'a> {
    /// The tag.
    pub tag: u32,
    /// The value.
    pub value: Value<'a>,
}

// No byte string is printed: key material may be inside.
impl std::fmt::Debug for Item<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:06X}:", self.tag)?;
        match &self.value {
            Value::Structure(v) => f.debug_list().entries(v).finish(),
            Value::Integer(x) => write!(f, "int {x}"),
            Value::LongInteger(x) => write!(f, "long {x}"),
            Value::BigInteger(b) => write!(f, "bigint ({} bytes)", b.len()),
            Value::Enumeration(x) => write!(f, "enum {x:#x}"),
            Value::Boolean(x) => write!(f, "bool {x}"),
            Value::Text(s) => write!(f, "text {s:?}"),
            Value::Bytes(b) => write!(f, "bytes ({} bytes)", b.len()),
            Value::DateTime(x) => write!(f, "datetime {x}"),
            Value::Interval(x) => write!(f, "interval {x}"),
        }
    }
}

/// Why bytes are not TTLV.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum TtlvError {
    /// Fewer bytes than an item's header or length says.
    #[error("TTLV cut short at byte {at}: need {need} more bytes")]
    Short {
        /// Offset of the item.
        at: usize,
        /// Bytes missing.
        need: usize,
    },
    /// A type byte this decoder does not know.
    #[error("TTLV item {tag:06X} at byte {at}: unknown type {typ:#04x}")]
    UnknownType {
        /// Offset.
        at: usize,
        /// Tag.
        tag: u32,
        /// Type byte.
        typ: u8,
    },
    /// A fixed-size type with another length, or a Big Integer not a multiple of 8.
    #[error("TTLV item {tag:06X} at byte {at}: length {len} is wrong for type {typ:#04x}")]
    BadLength {
        /// Offset.
        at: usize,
        /// Tag.
        tag: u32,
        /// Type.
        typ: u8,
        /// Length field.
        len: u32,
    },
    /// A Boolean other than 0 or 1.
    #[error("TTLV item {tag:06X} at byte {at}: boolean value is neither 0 nor 1")]
    BadBoolean {
        /// Offset.
        at: usize,
        /// Tag.
        tag: u32,
    },
    /// Text that is not UTF-8.
    #[error("TTLV item {tag:06X} at byte {at}: text string is not UTF-8")]
    BadText {
        /// Offset.
        at: usize,
        /// Tag.
        tag: u32,
    },
    /// A structure's items overrun or underfill its length.
    #[error("TTLV structure {tag:06X} at byte {at}: its items do not fill its length exactly")]
    BadStructure {
        /// Offset.
        at: usize,
        /// Tag.
        tag: u32,
    },
    /// Nesting deeper than [`MAX_DEPTH`].
    #[error("TTLV nesting deeper than {MAX_DEPTH} at byte {at}")]
    TooDeep {
        /// Offset.
        at: usize,
    },
    /// Bytes left after the top item.
    #[error("TTLV: {0} bytes after the message")]
    Trailing(usize),
}

fn padded(len: usize) -> usize {
    len.div_ceil(8) * 8
}

/// Decodes exactly one item filling `buf` (a whole message).
///
/// # Errors
/// [`TtlvError`] for anything not well formed.
pub fn decode(buf: &[u8]) -> Result<Item<'_>, TtlvError> {
    let (item, used) = decode_at(buf, 0, 0)?;
    if used != buf.len() {
        return Err(TtlvError::Trailing(buf.len() - used));
    }
    Ok(item)
}

/// Reads an item header: tag, type and the length of the value
/// (unpadded). Used to size the read of a message from a stream.
///
/// # Errors
/// [`TtlvError::Short`] under 8 bytes.
pub fn header(buf: &[u8]) -> Result<(u32, u8, u32), TtlvError> {
    if buf.len() < 8 {
        return Err(TtlvError::Short {
            at: 0,
            need: 8 - buf.len(),
        });
    }
    let tag = u32::from_be_bytes([0, buf[0], buf[1], buf[2]]);
    let len = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
    Ok((tag, buf[3], len))
}

fn decode_at(buf: &[u8], at: usize, depth: usize) -> Result<(Item<'_>, usize), TtlvError> {
    if depth > MAX_DEPTH {
        return Err(TtlvError::TooDeep { at });
    }
    let rest = buf.get(at..).unwrap_or_default();
    let (tag, typ, len32) = header(rest).map_err(|e| match e {
        TtlvError::Short { need, .. } => TtlvError::Short { at, need },
        e => e,
    })?;
    let len = usize::try_from(len32).unwrap_or(usize::MAX);
    let body = &rest[8..];
    // Structures carry their padding inside their length (their items are padded).
    let span = if typ == typ::STRUCTURE {
        len
    } else {
        padded(len.min(usize::MAX - 8))
    };
    if body.len() < span {
        return Err(TtlvError::Short {
            at,
            need: span - body.len(),
        });
    }
    let v = &body[..len.min(body.len())];
    let bad_len = || TtlvError::BadLength {
        at,
        tag,
        typ,
        len: len32,
    };
    let fixed = |n: usize| if len == n { Ok(()) } else { Err(bad_len()) };
    let be4 = |v: &[u8]| [v[0], v[1], v[2], v[3]];
    let be8 = |v: &[u8]| [v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7]];
    let value = match typ {
        typ::STRUCTURE => {
            let mut items = Vec::new();
            let mut off = 0usize;
            while off < len {
                let (item, used) = decode_at(v, off, depth + 1).map_err(|e| match e {
                    TtlvError::Short { .. } => TtlvError::BadStructure { at, tag },
                    e => e,
                })?;
                items.push(item);
                off += used;
            }
            if off != len {
                return Err(TtlvError::BadStructure { at, tag });
            }
            Value::Structure(items)
        }
        typ::INTEGER => {
            fixed(4)?;
            Value::Integer(i32::from_be_bytes(be4(v)))
        }
        typ::LONG_INTEGER => {
            fixed(8)?;
            Value::LongInteger(i64::from_be_bytes(be8(v)))
        }
        typ::BIG_INTEGER => {
            if len % 8 != 0 {
                return Err(bad_len());
            }
            Value::BigInteger(v)
        }
        typ::ENUMERATION => {
            fixed(4)?;
            Value::Enumeration(u32::from_be_bytes(be4(v)))
        }
        typ::BOOLEAN => {
            fixed(8)?;
            match u64::from_be_bytes(be8(v)) {
                0 => Value::Boolean(false),
                1 => Value::Boolean(true),
                _ => return Err(TtlvError::BadBoolean { at, tag }),
            }
        }
        typ::TEXT_STRING => {
            Value::Text(std::str::from_utf8(v).map_err(|_| TtlvError::BadText { at, tag })?)
        }
        typ::BYTE_STRING => Value::Bytes(v),
        typ::DATE_TIME => {
            fixed(8)?;
            Value::DateTime(i64::from_be_bytes(be8(v)))
        }
        typ::INTERVAL => {
            fixed(4)?;
            Value::Interval(u32::from_be_bytes(be4(v)))
        }
        _ => return Err(TtlvError::UnknownType { at, tag, typ }),
    };
    Ok((Item { tag, value }, 8 + span))
}

impl<'a> Item<'a> {
    /// An item.
    pub fn new(tag: u32, value: Value<'a>) -> Self {
        Self { tag, value }
    }

    /// A structure.
    pub fn structure(tag: u32, items: Vec<Item<'a>>) -> Self {
        Self::new(tag, Value::Structure(items))
    }

    /// Bytes this item takes encoded, padding included.
    pub fn encoded_len(&self) -> usize {
        8 + match &self.value {
            Value::Structure(v) => v.iter().map(Item::encoded_len).sum(),
            Value::Text(s) => padded(s.len()),
            Value::Bytes(b) | Value::BigInteger(b) => padded(b.len()),
            _ => 8,
        }
    }

    /// Encodes into the front of `out`, which must hold [`Item::encoded_len`]
    /// bytes; returns the bytes written.
    ///
    /// # Errors
    /// [`TtlvError::Short`] when `out` is too small or a value is longer than
    /// 4 GiB (nothing sensible is written then).
    pub fn encode(&self, out: &mut [u8]) -> Result<usize, TtlvError> {
        let n = self.encoded_len();
        if out.len() < n {
            return Err(TtlvError::Short {
                at: 0,
                need: n - out.len(),
            });
        }
        let tag = self.tag.to_be_bytes();
        out[..3].copy_from_slice(&tag[1..]);
        let (typ, len) = match &self.value {
            Value::Structure(v) => {
                let mut off = 8;
                for i in v {
                    off += i.encode(&mut out[off..n])?;
                }
                (typ::STRUCTURE, n - 8)
            }
            Value::Integer(x) => put(out, typ::INTEGER, &x.to_be_bytes()),
            Value::LongInteger(x) => put(out, typ::LONG_INTEGER, &x.to_be_bytes()),
            Value::BigInteger(b) => put(out, typ::BIG_INTEGER, b),
            Value::Enumeration(x) => put(out, typ::ENUMERATION, &x.to_be_bytes()),
            Value::Boolean(x) => put(out, typ::BOOLEAN, &u64::from(*x).to_be_bytes()),
            Value::Text(s) => put(out, typ::TEXT_STRING, s.as_bytes()),
            Value::Bytes(b) => put(out, typ::BYTE_STRING, b),
            Value::DateTime(x) => put(out, typ::DATE_TIME, &x.to_be_bytes()),
            Value::Interval(x) => put(out, typ::INTERVAL, &x.to_be_bytes()),
        };
        out[3] = typ;
        let len = u32::try_from(len).map_err(|_| TtlvError::Short { at: 0, need: 0 })?;
        out[4..8].copy_from_slice(&len.to_be_bytes());
        Ok(n)
    }

    /// Encodes into a new vector (for items that carry no secrets).
    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.encoded_len()];
        // The buffer is exactly encoded_len long; only a >4 GiB value fails.
        let _ = self.encode(&mut v);
        v
    }

    /// The first child with `tag`, when this is a structure.
    pub fn child(&self, tag: u32) -> Option<&Item<'a>> {
        self.children().iter().find(|i| i.tag == tag)
    }

    /// Every child with `tag`.
    pub fn all(&self, tag: u32) -> impl Iterator<Item = &Item<'a>> {
        self.children().iter().filter(move |i| i.tag == tag)
    }

    /// The children (empty for a primitive).
    pub fn children(&self) -> &[Item<'a>] {
        match &self.value {
            Value::Structure(v) => v,
            _ => &[],
        }
    }

    /// The enumeration value, if this is one.
    pub fn enumeration(&self) -> Option<u32> {
        match self.value {
            Value::Enumeration(x) => Some(x),
            _ => None,
        }
    }

    /// The integer value, if this is one.
    pub fn integer(&self) -> Option<i32> {
        match self.value {
            Value::Integer(x) => Some(x),
            _ => None,
        }
    }

    /// The text, if this is a text string.
    pub fn text(&self) -> Option<&'a str> {
        match self.value {
            Value::Text(s) => Some(s),
            _ => None,
        }
    }

    /// The bytes, if this is a byte string.
    pub fn bytes(&self) -> Option<&'a [u8]> {
        match self.value {
            Value::Bytes(b) => Some(b),
            _ => None,
        }
    }
}

/// Writes a primitive's value after the header and zero-pads it; returns
/// (type, unpadded length).
fn put(out: &mut [u8], typ: u8, v: &[u8]) -> (u8, usize) {
    let end = 8 + v.len();
    out[8..end].copy_from_slice(v);
    out[end..8 + padded(v.len())].fill(0);
    (typ, v.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    // KMIP 1.1 specification §9.1.2, "Examples".
    fn vector(item: Item<'_>, hexs: &str) {
        let want = hex::decode(hexs.replace([' ', '|'], "")).expect("hex");
        assert_eq!(hex::encode(item.to_vec()), hex::encode(&want), "{item:?}");
        assert_eq!(decode(&want).expect("decode"), item);
    }

    #[test]
    fn spec_examples() {
        vector(
            Item::new(0x420020, Value::Integer(8)),
            "420020 | 02 | 00000004 | 0000000800000000",
        );
        vector(
            Item::new(0x420020, Value::LongInteger(123_456_789_000_000_000)),
            "420020 | 03 | 00000008 | 01B69B4BA5749200",
        );
        let big = hex::decode("0000000003FD35EB6BC2DF4618080000").expect("hex");
        vector(
            Item::new(0x420020, Value::BigInteger(&big)),
            "420020 | 04 | 00000010 | 0000000003FD35EB6BC2DF4618080000",
        );
        vector(
            Item::new(0x420020, Value::Enumeration(255)),
            "420020 | 05 | 00000004 | 000000FF00000000",
        );
        vector(
            Item::new(0x420020, Value::Boolean(true)),
            "420020 | 06 | 00000008 | 0000000000000001",
        );
        vector(
            Item::new(0x420020, Value::Text("Hello World")),
            "420020 | 07 | 0000000B | 48656C6C6F20576F726C640000000000",
        );
        vector(
            Item::new(0x420020, Value::Bytes(&[1, 2, 3])),
            "420020 | 08 | 00000003 | 0102030000000000",
        );
        vector(
            Item::new(0x420020, Value::DateTime(0x47DA_67F8)),
            "420020 | 09 | 00000008 | 0000000047DA67F8",
        );
        vector(
            Item::new(0x420020, Value::Interval(864_000)),
            "420020 | 0A | 00000004 | 000D2F0000000000",
        );
        vector(
            Item::structure(
                0x420020,
                vec![
                    Item::new(0x420004, Value::Enumeration(254)),
                    Item::new(0x420005, Value::Integer(255)),
                ],
            ),
            "420020 | 01 | 00000020 | 420004 | 05 | 00000004 | 000000FE00000000 | 420005 | 02 | 00000004 | 000000FF00000000",
        );
    }

    #[test]
    fn refuses_malformed() {
        let h = |s: &str| hex::decode(s).expect("hex");
        // Cut short, wrong fixed length, bad boolean, bad UTF-8, unknown type, trailing bytes.
        assert!(matches!(
            decode(&[0x42, 0, 0x20, 2, 0, 0]),
            Err(TtlvError::Short { .. })
        ));
        let b = h("420020020000000500000008000000000000000000000000");
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::BadLength { .. })), "{e:?}");
        let b = h("42002006000000080000000000000002");
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::BadBoolean { .. })), "{e:?}");
        let b = h("4200200700000001FF00000000000000");
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::BadText { .. })), "{e:?}");
        let b = h("4200200B00000000");
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::UnknownType { .. })), "{e:?}");
        let mut t = Item::new(0x420020, Value::Integer(1)).to_vec();
        t.push(0);
        assert_eq!(decode(&t), Err(TtlvError::Trailing(1)));
        // A structure whose length ends inside a child.
        let b = h("42002001000000084200050200000004");
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::BadStructure { .. })), "{e:?}");
        // A length near u32::MAX.
        let b = h("42002008FFFFFFFF");
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::Short { .. })), "{e:?}");
    }

    #[test]
    fn refuses_deep_nesting() {
        let mut item = Item::new(0x420020, Value::Integer(1));
        for _ in 0..=MAX_DEPTH {
            item = Item::structure(0x420020, vec![item]);
        }
        let b = item.to_vec();
        let e = decode(&b);
        assert!(matches!(e, Err(TtlvError::TooDeep { .. })), "{e:?}");
    }

    fn arb_item() -> impl proptest::strategy::Strategy<Value = (u32, Vec<(u8, Vec<u8>, i64)>)> {
        use proptest::prelude::*;
        (
            0x420000u32..0x420100,
            proptest::collection::vec(
                (
                    0u8..9,
                    proptest::collection::vec(any::<u8>(), 0..40),
                    any::<i64>(),
                ),
                0..8,
            ),
        )
    }

    proptest::proptest! {
        #[test]
        fn round_trip((tag, kids) in arb_item()) {
            let texts: Vec<String> = kids.iter().map(|(_, b, _)| hex::encode(b)).collect();
            let items: Vec<Item<'_>> = kids.iter().zip(&texts).map(|((k, b, x), t)| {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let v = match k {
                    0 => Value::Integer(*x as i32),
                    1 => Value::LongInteger(*x),
                    2 => Value::Enumeration(*x as u32),
                    3 => Value::Boolean(*x & 1 == 1),
                    4 => Value::Text(t),
                    5 => Value::Bytes(b),
                    6 => Value::DateTime(*x),
                    7 => Value::Interval(*x as u32),
                    _ => Value::Structure(vec![Item::new(tag, Value::Bytes(b))]),
                };
                Item::new(tag, v)
            }).collect();
            let s = Item::structure(tag, items);
            let bytes = s.to_vec();
            proptest::prop_assert_eq!(bytes.len() % 8, 0);
            proptest::prop_assert_eq!(decode(&bytes).expect("decode"), s);
        }

        #[test]
        fn never_panics(b in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256)) {
            let _ = decode(&b);
        }
    }
}
