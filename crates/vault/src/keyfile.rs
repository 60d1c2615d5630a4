//! Key and certificate files, read on the client's side of the vault:
//! PKCS#8, PKCS#1 and SEC 1 private keys (PEM or DER), OpenSSH private keys
//! (`openssh-key-v1`, unencrypted), X.509 certificates; and the public-key
//! encodings clients hand out (SubjectPublicKeyInfo, OpenSSH's
//! `authorized_keys` line and wire blob).
//!
//! Private keys become the vault's import format
//! ([`memveil_asym::components`]) written into a buffer the caller owns
//! (the CLI keeps it in locked memory and wipes it; `memveil agent` in secret
//! memory); nothing here copies a private byte anywhere else — decoding
//! borrows from the caller's buffers. Encrypted key files are refused with
//! the command that decrypts them. Sans-IO, no `unsafe`, never a panic on
//! any input (proptest and the `keyfile` fuzz target).
#![forbid(unsafe_code)]

use base64ct::{Base64, Encoding as _};
use memveil_asym::components::{encode_into, encoded_len};
use memveil_asym::{Algorithm, Curve, Public};

use crate::proto::KeyKind;

/// Why a file did not give a key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum KeyFileError {
    /// Not a format this reader knows.
    #[error("not a key or certificate this reader knows: {0} (PEM PKCS#8 \"PRIVATE KEY\", \"RSA PRIVATE KEY\", \"EC PRIVATE KEY\", \"OPENSSH PRIVATE KEY\", \"CERTIFICATE\", or their DER)")]
    Unknown(&'static str),
    /// Encrypted; the message names how to decrypt it.
    #[error("the key file is encrypted: {0}")]
    Encrypted(&'static str),
    /// Malformed DER, PEM or OpenSSH structure.
    #[error("malformed {0}")]
    Malformed(&'static str),
    /// A key type or size the vault does not hold.
    #[error(
        "unsupported key: {0} (the vault holds RSA 2048/3072/4096, P-256, P-384 and Ed25519 keys)"
    )]
    Unsupported(String),
    /// The caller's buffer is too small.
    #[error("buffer too small for the key ({0} bytes needed)")]
    Short(usize),
}

type R<T> = Result<T, KeyFileError>;

// ------------------------------------------------------------------ DER

/// One DER element: its tag and contents.
#[derive(Debug, Clone, Copy)]
pub struct Tlv<'a> {
    /// The tag byte.
    pub tag: u8,
    /// The contents.
    pub body: &'a [u8],
    /// The whole element (tag, length, contents).
    pub raw: &'a [u8],
}

/// Reads DER elements in sequence from a byte string.
#[derive(Debug, Clone, Copy)]
pub struct Der<'a> {
    b: &'a [u8],
}

const SEQ: u8 = 0x30;
const INT: u8 = 0x02;
const OCTETS: u8 = 0x04;
const OID: u8 = 0x06;
const BITS: u8 = 0x03;
const NULL: u8 = 0x05;

impl<'a> Der<'a> {
    /// A reader over `b`.
    #[must_use]
    pub fn new(b: &'a [u8]) -> Self {
        Der { b }
    }

    /// Whether everything was read.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.b.is_empty()
    }

    /// The next element.
    ///
    /// # Errors
    /// A truncated element or an indefinite or overlong length.
    pub fn element(&mut self) -> R<Tlv<'a>> {
        let bad = KeyFileError::Malformed("DER");
        let all = self.b;
        let (&tag, rest) = all.split_first().ok_or(bad.clone())?;
        let (&l0, rest) = rest.split_first().ok_or(bad.clone())?;
        let (len, rest) = if l0 < 0x80 {
            (usize::from(l0), rest)
        } else {
            let n = usize::from(l0 & 0x7f);
            if n == 0 || n > 3 {
                return Err(bad);
            }
            let (lb, rest) = rest.split_at_checked(n).ok_or(bad.clone())?;
            (
                lb.iter().fold(0usize, |a, b| a << 8 | usize::from(*b)),
                rest,
            )
        };
        let (body, rest) = rest.split_at_checked(len).ok_or(bad)?;
        let used = all.len() - rest.len();
        self.b = rest;
        Ok(Tlv {
            tag,
            body,
            raw: &all[..used],
        })
    }

    /// The next element, which must carry `tag`.
    ///
    /// # Errors
    /// As [`Der::element`], or another tag.
    pub fn expect(&mut self, tag: u8, what: &'static str) -> R<&'a [u8]> {
        let t = self.element()?;
        if t.tag == tag {
            Ok(t.body)
        } else {
            Err(KeyFileError::Malformed(what))
        }
    }

    /// The next INTEGER's magnitude, big-endian without leading zeros.
    ///
    /// # Errors
    /// As [`Der::expect`]; a negative integer.
    pub fn uint(&mut self, what: &'static str) -> R<&'a [u8]> {
        let v = self.expect(INT, what)?;
        if v.first().is_some_and(|b| b & 0x80 != 0) {
            return Err(KeyFileError::Malformed(what));
        }
        let zeros = v.iter().take_while(|b| **b == 0).count();
        Ok(&v[zeros..])
    }
}

fn der_len(out: &mut Vec<u8>, n: usize) {
    match n {
        0..=0x7f => out.push(u8::try_from(n).unwrap_or(0)),
        0x80..=0xff => out.extend([0x81, u8::try_from(n).unwrap_or(0)]),
        _ => {
            let b = u16::try_from(n).unwrap_or(u16::MAX).to_be_bytes();
            out.extend([0x82, b[0], b[1]]);
        }
    }
}

/// A DER element of `tag` around `body`.
#[must_use]
pub fn der(tag: u8, body: &[u8]) -> Vec<u8> {
    let mut v = vec![tag];
    der_len(&mut v, body.len());
    v.extend_from_slice(body);
    v
}

fn der_uint(mag: &[u8]) -> Vec<u8> {
    let mag = &mag[mag.iter().take_while(|b| **b == 0).count()..];
    let mut body = Vec::with_capacity(mag.len() + 1);
    if mag.is_empty() || mag[0] & 0x80 != 0 {
        body.push(0);
    }
    body.extend_from_slice(mag);
    der(INT, &body)
}

const OID_RSA: &[u8] = &[0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01];
const OID_EC: &[u8] = &[0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
const OID_ED25519: &[u8] = &[0x2b, 0x65, 0x70];

fn curve_of_oid(oid: &[u8]) -> R<Curve> {
    for c in [Curve::P256, Curve::P384] {
        if c.oid_der().get(2..) == Some(oid) {
            return Ok(c);
        }
    }
    Err(KeyFileError::Unsupported(
        "an EC curve other than P-256 and P-384".into(),
    ))
}

/// The size in bits of a big-endian modulus `n` (leading zero bytes and
/// bits not counted; 0 for an empty or all-zero `n`).
#[must_use]
pub fn rsa_bits(n: &[u8]) -> usize {
    let n = &n[n.iter().take_while(|b| **b == 0).count()..];
    (n.len() * 8).saturating_sub(n.first().map_or(0, |b| b.leading_zeros() as usize))
}

fn rsa_kind(n: &[u8]) -> R<KeyKind> {
    match rsa_bits(n) {
        2048 => Ok(KeyKind::Rsa2048),
        3072 => Ok(KeyKind::Rsa3072),
        4096 => Ok(KeyKind::Rsa4096),
        b => Err(KeyFileError::Unsupported(format!("an RSA key of {b} bits"))),
    }
}

fn ec_kind(c: Curve) -> KeyKind {
    match c {
        Curve::P256 => KeyKind::P256,
        Curve::P384 => KeyKind::P384,
    }
}

fn put(fields: &[&[u8]], out: &mut [u8]) -> R<usize> {
    encode_into(fields, out).ok_or(KeyFileError::Short(encoded_len(fields)))
}

fn pkcs1(body: &[u8], out: &mut [u8]) -> R<(KeyKind, usize)> {
    let mut d = Der::new(body);
    let mut s = Der::new(d.expect(SEQ, "RSAPrivateKey")?);
    let _version = s.uint("RSAPrivateKey version")?;
    let mut f: [&[u8]; 8] = [&[]; 8];
    for (i, what) in ["n", "e", "d", "p", "q", "dp", "dq", "qinv"]
        .iter()
        .enumerate()
    {
        f[i] = s.uint(what)?;
    }
    let kind = rsa_kind(f[0])?;
    Ok((kind, put(&f, out)?))
}

fn sec1(body: &[u8], curve: Option<Curve>, out: &mut [u8]) -> R<(KeyKind, usize)> {
    let mut d = Der::new(body);
    let mut s = Der::new(d.expect(SEQ, "ECPrivateKey")?);
    let _version = s.uint("ECPrivateKey version")?;
    let scalar = s.expect(OCTETS, "ECPrivateKey scalar")?;
    let mut curve = curve;
    while !s.is_empty() {
        let t = s.element()?;
        if t.tag == 0xa0 {
            curve = Some(curve_of_oid(
                Der::new(t.body).expect(OID, "EC parameters")?,
            )?);
        }
    }
    let c = curve.ok_or(KeyFileError::Malformed("ECPrivateKey without a curve"))?;
    if scalar.len() > c.field_bytes() {
        return Err(KeyFileError::Malformed("EC scalar longer than the field"));
    }
    Ok((ec_kind(c), put(&[scalar], out)?))
}

fn pkcs8(body: &[u8], out: &mut [u8]) -> R<(KeyKind, usize)> {
    let mut d = Der::new(body);
    let mut s = Der::new(d.expect(SEQ, "PrivateKeyInfo")?);
    let _version = s.uint("PrivateKeyInfo version")?;
    let mut alg = Der::new(s.expect(SEQ, "AlgorithmIdentifier")?);
    let oid = alg.expect(OID, "algorithm OID")?;
    let key = s.expect(OCTETS, "private key")?;
    if oid == OID_RSA {
        pkcs1(key, out)
    } else if oid == OID_EC {
        let c = curve_of_oid(alg.expect(OID, "EC curve")?)?;
        sec1(key, Some(c), out)
    } else if oid == OID_ED25519 {
        let seed = Der::new(key).expect(OCTETS, "Ed25519 seed")?;
        if seed.len() != 32 {
            return Err(KeyFileError::Malformed("Ed25519 seed of the wrong length"));
        }
        Ok((KeyKind::Ed25519, put(&[seed], out)?))
    } else {
        Err(KeyFileError::Unsupported(
            "a PKCS#8 key that is not RSA, EC or Ed25519".into(),
        ))
    }
}

// ------------------------------------------------------------------ OpenSSH

/// Reads OpenSSH's wire encoding (RFC 4251: `uint32`, `string`, `mpint`).
#[derive(Debug, Clone, Copy)]
pub struct Ssh<'a> {
    b: &'a [u8],
}

impl<'a> Ssh<'a> {
    /// A reader over `b`.
    #[must_use]
    pub fn new(b: &'a [u8]) -> Self {
        Ssh { b }
    }

    /// Bytes not read yet.
    #[must_use]
    pub fn rest(&self) -> &'a [u8] {
        self.b
    }

    /// A `uint32`.
    ///
    /// # Errors
    /// Truncated input.
    pub fn u32(&mut self) -> R<u32> {
        let (h, t) = self
            .b
            .split_at_checked(4)
            .ok_or(KeyFileError::Malformed("SSH uint32"))?;
        self.b = t;
        Ok(u32::from_be_bytes([h[0], h[1], h[2], h[3]]))
    }

    /// A byte.
    ///
    /// # Errors
    /// Truncated input.
    pub fn u8(&mut self) -> R<u8> {
        let (&h, t) = self
            .b
            .split_first()
            .ok_or(KeyFileError::Malformed("SSH byte"))?;
        self.b = t;
        Ok(h)
    }

    /// A `string`.
    ///
    /// # Errors
    /// Truncated input.
    pub fn string(&mut self) -> R<&'a [u8]> {
        let n = usize::try_from(self.u32()?).map_err(|_| KeyFileError::Malformed("SSH string"))?;
        let (h, t) = self
            .b
            .split_at_checked(n)
            .ok_or(KeyFileError::Malformed("SSH string"))?;
        self.b = t;
        Ok(h)
    }

    /// An `mpint`'s magnitude (non-negative), without leading zeros.
    ///
    /// # Errors
    /// Truncated input or a negative number.
    pub fn mpint(&mut self) -> R<&'a [u8]> {
        let v = self.string()?;
        if v.first().is_some_and(|b| b & 0x80 != 0) {
            return Err(KeyFileError::Malformed("SSH mpint (negative)"));
        }
        Ok(&v[v.iter().take_while(|b| **b == 0).count()..])
    }
}

/// The private fields of one OpenSSH key of type `keytype` (what follows the
/// type in an `openssh-key-v1` private section and in ssh-agent's
/// `SSH_AGENTC_ADD_IDENTITY`), as vault components into `out`.
///
/// # Errors
/// Malformed or unsupported keys; a short `out`.
pub fn ssh_private(keytype: &[u8], r: &mut Ssh<'_>, out: &mut [u8]) -> R<(KeyKind, usize)> {
    match keytype {
        b"ssh-rsa" => {
            let (n, e, d, iqmp, p, q) = (
                r.mpint()?,
                r.mpint()?,
                r.mpint()?,
                r.mpint()?,
                r.mpint()?,
                r.mpint()?,
            );
            let kind = rsa_kind(n)?;
            Ok((kind, put(&[n, e, d, p, q, &[], &[], iqmp], out)?))
        }
        b"ecdsa-sha2-nistp256" | b"ecdsa-sha2-nistp384" => {
            let c = if keytype.ends_with(b"256") {
                Curve::P256
            } else {
                Curve::P384
            };
            if r.string()? != c.ssh_name().as_bytes() {
                return Err(KeyFileError::Malformed(
                    "ECDSA key whose curve does not match its type",
                ));
            }
            let _q = r.string()?;
            let d = r.mpint()?;
            if d.len() > c.field_bytes() {
                return Err(KeyFileError::Malformed("EC scalar longer than the field"));
            }
            Ok((ec_kind(c), put(&[d], out)?))
        }
        b"ssh-ed25519" => {
            let _pk = r.string()?;
            let sk = r.string()?;
            let seed = sk
                .get(..32)
                .filter(|_| sk.len() == 64)
                .ok_or(KeyFileError::Malformed(
                    "Ed25519 private key of the wrong length",
                ))?;
            Ok((KeyKind::Ed25519, put(&[seed], out)?))
        }
        other => Err(KeyFileError::Unsupported(format!(
            "SSH key type {:?}",
            String::from_utf8_lossy(other)
        ))),
    }
}

fn openssh(b: &[u8], out: &mut [u8]) -> R<(KeyKind, usize)> {
    let body = b
        .strip_prefix(b"openssh-key-v1\0")
        .ok_or(KeyFileError::Malformed("OpenSSH key (magic)"))?;
    let mut r = Ssh::new(body);
    let cipher = r.string()?;
    let _kdf = r.string()?;
    let _kdf_opts = r.string()?;
    if cipher != b"none" {
        return Err(KeyFileError::Encrypted(
            "decrypt a copy first: cp KEY k && ssh-keygen -p -N '' -f k (then import k and shred it)",
        ));
    }
    if r.u32()? != 1 {
        return Err(KeyFileError::Unsupported(
            "an OpenSSH file with several keys".into(),
        ));
    }
    let _public = r.string()?;
    let mut p = Ssh::new(r.string()?);
    if p.u32()? != p.u32()? {
        return Err(KeyFileError::Malformed("OpenSSH key (check words differ)"));
    }
    let keytype = p.string()?;
    ssh_private(keytype, &mut p, out)
}

// ------------------------------------------------------------------ PEM

/// The label and base64 body of the first PEM block in `text`.
fn pem_block(text: &[u8]) -> Option<(&[u8], &[u8])> {
    const BEGIN: &[u8] = b"-----BEGIN ";
    let at = text.windows(BEGIN.len()).position(|w| w == BEGIN)?;
    let after = &text[at + BEGIN.len()..];
    let end_label = after.windows(5).position(|w| w == b"-----")?;
    let label = &after[..end_label];
    let body = &after[end_label + 5..];
    let end = body.windows(9).position(|w| w == b"-----END ")?;
    Some((label, &body[..end]))
}

/// Base64 of a PEM body (whitespace dropped) decoded into `scratch`.
fn unbase64<'s>(body: &[u8], scratch: &'s mut [u8]) -> R<&'s [u8]> {
    let mut n = 0;
    for b in body.iter().filter(|b| !b.is_ascii_whitespace()) {
        *scratch.get_mut(n).ok_or(KeyFileError::Short(body.len()))? = *b;
        n += 1;
    }
    // Decode in place: the decoded bytes never outrun the encoded ones.
    let (src, dst) = scratch.split_at_mut(n);
    let len = Base64::decode(&*src, dst)
        .map_err(|_| KeyFileError::Malformed("PEM base64"))?
        .len();
    src.iter_mut().for_each(|b| *b = 0);
    Ok(&scratch[n..n + len])
}

/// What a file holds: a private key of `kind` whose components are the
/// first `len` bytes of the caller's `out`, or a certificate (its DER in
/// `out`).
///
/// `scratch` holds the decoded PEM (at least twice the input's length);
/// both buffers are the caller's to keep in locked or secret memory and
/// to wipe.
///
/// # Errors
/// [`KeyFileError`] naming what is wrong and, for an encrypted file, how
/// to decrypt it.
pub fn read_private(input: &[u8], scratch: &mut [u8], out: &mut [u8]) -> R<(KeyKind, usize)> {
    if let Some((label, body)) = pem_block(input) {
        if body.windows(9).any(|w| w == b"ENCRYPTED") || label == b"ENCRYPTED PRIVATE KEY" {
            return Err(KeyFileError::Encrypted(
                "decrypt a copy first: openssl pkey -in KEY -out k (then import k and shred it)",
            ));
        }
        let der = unbase64(body, scratch)?;
        return match label {
            b"PRIVATE KEY" => pkcs8(der, out),
            b"RSA PRIVATE KEY" => pkcs1(der, out),
            b"EC PRIVATE KEY" => sec1(der, None, out),
            b"OPENSSH PRIVATE KEY" => openssh(der, out),
            b"CERTIFICATE" => {
                let o = out
                    .get_mut(..der.len())
                    .ok_or(KeyFileError::Short(der.len()))?;
                o.copy_from_slice(der);
                Ok((KeyKind::Cert, der.len()))
            }
            _ => Err(KeyFileError::Unknown("a PEM block of another type")),
        };
    }
    if input.starts_with(b"openssh-key-v1\0") {
        return openssh(input, out);
    }
    if input.first() == Some(&SEQ) {
        // DER: PKCS#8, then PKCS#1, SEC 1, a certificate.
        if let Ok(r) = pkcs8(input, out) {
            return Ok(r);
        }
        if let Ok(r) = pkcs1(input, out) {
            return Ok(r);
        }
        if let Ok(r) = sec1(input, None, out) {
            return Ok(r);
        }
        if cert_fields(input).is_ok() {
            let o = out
                .get_mut(..input.len())
                .ok_or(KeyFileError::Short(input.len()))?;
            o.copy_from_slice(input);
            return Ok((KeyKind::Cert, input.len()));
        }
    }
    Err(KeyFileError::Unknown("neither PEM nor DER nor OpenSSH"))
}

// ------------------------------------------------------------------ certificates

/// The parts of a certificate PKCS#11 shows: serial number (the INTEGER's
/// DER), issuer and subject (their `Name` DER), and the public key's
/// SubjectPublicKeyInfo DER.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFields<'a> {
    /// `CKA_SERIAL_NUMBER`.
    pub serial: &'a [u8],
    /// `CKA_ISSUER`.
    pub issuer: &'a [u8],
    /// `CKA_SUBJECT`.
    pub subject: &'a [u8],
    /// `CKA_PUBLIC_KEY_INFO`.
    pub spki: &'a [u8],
}

/// Reads a certificate's fields.
///
/// # Errors
/// Not an X.509 certificate.
pub fn cert_fields(der_bytes: &[u8]) -> R<CertFields<'_>> {
    let mut d = Der::new(der_bytes);
    let mut c = Der::new(d.expect(SEQ, "Certificate")?);
    let mut tbs = Der::new(c.expect(SEQ, "TBSCertificate")?);
    let mut t = tbs.element()?;
    if t.tag == 0xa0 {
        t = tbs.element()?;
    }
    if t.tag != INT {
        return Err(KeyFileError::Malformed("certificate serial"));
    }
    let serial = t.raw;
    let _sig = tbs.expect(SEQ, "certificate signature algorithm")?;
    let issuer = tbs.element()?.raw;
    let _validity = tbs.expect(SEQ, "certificate validity")?;
    let subject = tbs.element()?.raw;
    let spki = tbs.element()?;
    if spki.tag != SEQ {
        return Err(KeyFileError::Malformed("certificate public key"));
    }
    Ok(CertFields {
        serial,
        issuer,
        subject,
        spki: spki.raw,
    })
}

// ------------------------------------------------------------------ public keys

/// The SubjectPublicKeyInfo DER of a public key (what `openssl pkey -pubin`
/// reads, and PKCS#11's `CKA_PUBLIC_KEY_INFO`).
#[must_use]
pub fn spki_der(p: &Public) -> Vec<u8> {
    let (alg, key) = match p {
        Public::Rsa { n, e } => {
            let mut body = der_uint(n);
            body.extend(der_uint(e));
            let mut a = der(OID, OID_RSA);
            a.extend(der(NULL, &[]));
            (der(SEQ, &a), der(SEQ, &body))
        }
        Public::Ec { curve, point } => {
            let mut a = der(OID, OID_EC);
            a.extend_from_slice(curve.oid_der());
            (der(SEQ, &a), point.clone())
        }
        Public::Ed25519(pk) => (der(SEQ, &der(OID, OID_ED25519)), pk.to_vec()),
    };
    let mut bits = vec![0u8];
    bits.extend(key);
    let mut body = alg;
    body.extend(der(BITS, &bits));
    der(SEQ, &body)
}

/// `der` as PEM with `label`.
#[must_use]
pub fn pem(label: &str, der_bytes: &[u8]) -> String {
    let b64 = Base64::encode_string(der_bytes);
    let mut s = format!("-----BEGIN {label}-----\n");
    for chunk in b64.as_bytes().chunks(64) {
        s.push_str(&String::from_utf8_lossy(chunk));
        s.push('\n');
    }
    s.push_str(&format!("-----END {label}-----\n"));
    s
}

fn ssh_string(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&u32::try_from(b.len()).unwrap_or(u32::MAX).to_be_bytes());
    out.extend_from_slice(b);
}

fn ssh_mpint(out: &mut Vec<u8>, mag: &[u8]) {
    let mag = &mag[mag.iter().take_while(|b| **b == 0).count()..];
    let pad = mag.first().is_some_and(|b| b & 0x80 != 0);
    out.extend_from_slice(
        &u32::try_from(mag.len() + usize::from(pad))
            .unwrap_or(u32::MAX)
            .to_be_bytes(),
    );
    if pad {
        out.push(0);
    }
    out.extend_from_slice(mag);
}

/// OpenSSH's key type name of a public key.
#[must_use]
pub fn ssh_type(p: &Public) -> &'static str {
    match p {
        Public::Rsa { .. } => "ssh-rsa",
        Public::Ec {
            curve: Curve::P256, ..
        } => "ecdsa-sha2-nistp256",
        Public::Ec {
            curve: Curve::P384, ..
        } => "ecdsa-sha2-nistp384",
        Public::Ed25519(_) => "ssh-ed25519",
    }
}

/// OpenSSH's public key blob (RFC 4253 6.6, RFC 5656, RFC 8709).
#[must_use]
pub fn ssh_blob(p: &Public) -> Vec<u8> {
    let mut v = Vec::new();
    ssh_string(&mut v, ssh_type(p).as_bytes());
    match p {
        Public::Rsa { n, e } => {
            ssh_mpint(&mut v, e);
            ssh_mpint(&mut v, n);
        }
        Public::Ec { curve, point } => {
            ssh_string(&mut v, curve.ssh_name().as_bytes());
            ssh_string(&mut v, point);
        }
        Public::Ed25519(pk) => ssh_string(&mut v, pk),
    }
    v
}

/// The public key of an OpenSSH blob.
///
/// # Errors
/// A malformed or unsupported blob.
pub fn ssh_public(blob: &[u8]) -> R<Public> {
    let mut r = Ssh::new(blob);
    let t = r.string()?;
    let p = match t {
        b"ssh-rsa" => {
            let e = r.mpint()?.to_vec();
            let n = r.mpint()?.to_vec();
            Public::Rsa { n, e }
        }
        b"ecdsa-sha2-nistp256" | b"ecdsa-sha2-nistp384" => {
            let curve = if t.ends_with(b"256") {
                Curve::P256
            } else {
                Curve::P384
            };
            if r.string()? != curve.ssh_name().as_bytes() {
                return Err(KeyFileError::Malformed("ECDSA blob curve"));
            }
            Public::Ec {
                curve,
                point: r.string()?.to_vec(),
            }
        }
        b"ssh-ed25519" => Public::Ed25519(
            r.string()?
                .try_into()
                .map_err(|_| KeyFileError::Malformed("Ed25519 public key length"))?,
        ),
        other => {
            return Err(KeyFileError::Unsupported(format!(
                "SSH key type {:?}",
                String::from_utf8_lossy(other)
            )))
        }
    };
    if r.rest().is_empty() {
        Ok(p)
    } else {
        Err(KeyFileError::Malformed("trailing bytes in an SSH key blob"))
    }
}

/// An `authorized_keys` line: type, base64 blob, comment.
#[must_use]
pub fn ssh_line(p: &Public, comment: &str) -> String {
    format!(
        "{} {} {comment}",
        ssh_type(p),
        Base64::encode_string(&ssh_blob(p))
    )
}

/// The vault kind of a public key.
#[must_use]
pub fn kind_of(p: &Public) -> KeyKind {
    match p {
        Public::Rsa { n, .. } => rsa_kind(n).unwrap_or(KeyKind::Rsa2048),
        Public::Ec { curve, .. } => ec_kind(*curve),
        Public::Ed25519(_) => KeyKind::Ed25519,
    }
}

/// The algorithm of an asymmetric kind, for callers that hold a kind.
#[must_use]
pub fn algorithm(kind: KeyKind) -> Option<Algorithm> {
    kind.asym()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read(input: &[u8]) -> R<(KeyKind, Vec<u8>)> {
        let mut scratch = vec![0u8; 2 * input.len() + 64];
        let mut out = vec![0u8; 4096];
        let (k, n) = read_private(input, &mut scratch, &mut out)?;
        Ok((k, out[..n].to_vec()))
    }

    #[test]
    fn every_openssl_format_gives_the_same_components() {
        let rsa = openssl::rsa::Rsa::generate(2048).expect("rsa");
        let pk = openssl::pkey::PKey::from_rsa(rsa.clone()).expect("pkey");
        let want = read(&pk.private_key_to_pem_pkcs8().expect("pem")).expect("pkcs8");
        assert_eq!(want.0, KeyKind::Rsa2048);
        for f in [
            rsa.private_key_to_pem().expect("pkcs1 pem"),
            rsa.private_key_to_der().expect("pkcs1 der"),
            pk.private_key_to_der().expect("pkcs8 der"),
        ] {
            assert_eq!(read(&f).expect("read"), want);
        }
        let f = memveil_asym::components::decode(&want.1).expect("fields");
        assert_eq!(f[0], rsa.n().to_vec());
        assert_eq!(f[3], rsa.p().expect("p").to_vec());
        // EC: SEC 1 and PKCS#8.
        for (nid, kind) in [
            (openssl::nid::Nid::X9_62_PRIME256V1, KeyKind::P256),
            (openssl::nid::Nid::SECP384R1, KeyKind::P384),
        ] {
            let g = openssl::ec::EcGroup::from_curve_name(nid).expect("group");
            let ec = openssl::ec::EcKey::generate(&g).expect("ec");
            let pk = openssl::pkey::PKey::from_ec_key(ec.clone()).expect("pkey");
            let a = read(&ec.private_key_to_pem().expect("sec1")).expect("sec1");
            let b = read(&pk.private_key_to_pem_pkcs8().expect("pkcs8")).expect("pkcs8");
            assert_eq!(a, b);
            assert_eq!(a.0, kind);
        }
        let ed = openssl::pkey::PKey::generate_ed25519().expect("ed");
        let (k, c) = read(&ed.private_key_to_pem_pkcs8().expect("pem")).expect("ed");
        assert_eq!(k, KeyKind::Ed25519);
        assert_eq!(
            memveil_asym::components::decode(&c).expect("f")[0],
            ed.raw_private_key().expect("seed")
        );
        // Encrypted PEM is refused with the fix.
        let enc = pk
            .private_key_to_pem_pkcs8_passphrase(openssl::symm::Cipher::aes_128_cbc(), b"pw")
            .expect("enc");
        assert!(matches!(read(&enc), Err(KeyFileError::Encrypted(_))));
    }

    #[test]
    fn public_encodings_match_openssl() {
        let rsa = openssl::rsa::Rsa::generate(2048).expect("rsa");
        let p = Public::Rsa {
            n: rsa.n().to_vec(),
            e: rsa.e().to_vec(),
        };
        assert_eq!(spki_der(&p), rsa.public_key_to_der().expect("spki"));
        let ed = openssl::pkey::PKey::generate_ed25519().expect("ed");
        let p = Public::Ed25519(ed.raw_public_key().expect("pk").try_into().expect("32"));
        assert_eq!(spki_der(&p), ed.public_key_to_der().expect("spki"));
        assert_eq!(ssh_public(&ssh_blob(&p)).expect("blob"), p);
        let pem_text = pem("PUBLIC KEY", &spki_der(&p));
        assert!(openssl::pkey::PKey::public_key_from_pem(pem_text.as_bytes()).is_ok());
    }

    /// The `keyfile` fuzz target's crash: a PKCS#1 key whose modulus is
    /// empty made the bit count subtract 8 from 0.
    #[test]
    fn an_empty_or_zero_modulus_is_refused_not_a_panic() {
        assert_eq!(rsa_bits(&[]), 0);
        assert_eq!(rsa_bits(&[0, 0]), 0);
        assert_eq!(rsa_bits(&[0, 0x80, 0]), 16);
        assert_eq!(rsa_bits(&[1]), 1);
        let crash = [
            0x30, 0x3f, 0x02, 0x02, 0x02, 0x02, 0x02, 0x01, 0x00, 0x02, 0x02, 0x02, 0x02, 0x02,
            0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x7e, 0x02, 0x02, 0x02, 0xe4, 0x02, 0x02, 0x02,
            0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x01, 0x00, 0x02,
            0x02, 0xfe, 0xfd, 0xfd, 0xfe, 0x02, 0x02, 0x02, 0x02, 0x00, 0x02, 0x02, 0x02, 0x02,
            0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02, 0x02,
            0x80,
        ];
        assert!(read(&crash).is_err());
        let mut out = [0u8; 64];
        assert!(matches!(
            pkcs1(
                &crate::keyfile::der(
                    SEQ,
                    &[
                        2, 1, 0, 2, 0, 2, 1, 3, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1, 1, 2, 1,
                        1
                    ]
                ),
                &mut out
            ),
            Err(KeyFileError::Unsupported(_))
        ));
    }

    proptest! {
        #[test]
        fn arbitrary_input_never_panics(b in proptest::collection::vec(any::<u8>(), 0..400)) {
            let _ = read(&b);
            let _ = cert_fields(&b);
            let _ = ssh_public(&b);
            let mut pem_text = b"-----BEGIN PRIVATE KEY-----\n".to_vec();
            pem_text.extend(Base64::encode_string(&b).as_bytes());
            pem_text.extend(b"\n-----END PRIVATE KEY-----\n");
            let _ = read(&pem_text);
            let mut ssh = b"openssh-key-v1\0".to_vec();
            ssh.extend(&b);
            let _ = read(&ssh);
        }
    }
}
