//! The byte layout of PyTorch's c10d `TCPStore` protocol: pure encoding and decoding, no I/O.
//!
//! Unlike our own protocol ([`crate::store::wire`]) this one has no frames: a request is a
//! one-byte [`QueryType`] followed by its arguments, and each reply has a shape the client must
//! know from the request it sent. Integers are in the host's byte order in torch's sources;
//! every platform torch ships for is little-endian, so they are little-endian here.
//!
//! | request | arguments | reply |
//! |---|---|---|
//! | `VALIDATE` (0) | `u32` [`VALIDATION_MAGIC`] | none (a wrong magic is ignored in silence) |
//! | `PING` (13) | `u32` nonce | the same `u32` |
//! | `SET` (1) | key, value | none (the client follows it with a `PING` to know it is done) |
//! | `COMPARE_SET` (2) | key, expected, desired | bytes: the value now stored |
//! | `GET` (3) | key | bytes (empty when the key is absent: it does not wait) |
//! | `ADD` (4) | key, `i64` delta | `i64` new value (stored as decimal text) |
//! | `CHECK` (5) | `u64` count, keys | `u8`: 0 ready, 1 not ready |
//! | `WAIT` (6) | `u64` count, keys | `u8` 0 (stop waiting) once every key is set |
//! | `DELETE_KEY` (8) | key | `i64` number of keys removed (0 or 1) |
//! | `CANCEL_WAIT` (12) | none | `u8` 1 (wait canceled), after a pending 0 if the wait ended first |
//!
//! Keys and values are a `u64` length then the bytes. The server closes the connection on a
//! key over [`MAX_KEY_LEN`] or a value over [`MAX_VALUE_LEN`], so the client refuses them first.

use crate::error::WireError;

/// What the client sends after connecting, so the server knows it speaks this protocol
/// (`validationMagicNumber` in torch's `TCPStoreBackend.hpp`).
pub const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;

/// Longest key the server accepts (libuv backend's `MAX_STRING_LEN`).
pub const MAX_KEY_LEN: usize = 8 * 1024;

/// Largest value the server accepts in one request (libuv backend's `MAX_PAYLOAD_LEN`).
pub const MAX_VALUE_LEN: usize = 8 * 1024 * 1024;

/// Largest value the client accepts in a reply. Values grow past [`MAX_VALUE_LEN`] only through
/// `APPEND`, which nothing here uses; a longer length is a confused or hostile peer, refused
/// before allocating.
pub const MAX_REPLY_LEN: usize = 64 * 1024 * 1024;

/// The first byte of every request (torch's `QueryType`; only the ones this client sends).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum QueryType {
    Validate = 0,
    Set = 1,
    CompareSet = 2,
    Get = 3,
    Add = 4,
    Check = 5,
    Wait = 6,
    DeleteKey = 8,
    CancelWait = 12,
    Ping = 13,
}

/// The reply to `CHECK`.
const CHECK_READY: u8 = 0;
const CHECK_NOT_READY: u8 = 1;

/// A reply to `WAIT` or `CANCEL_WAIT`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitReply {
    /// Every key of the wait is set (torch's `STOP_WAITING`).
    StopWaiting,
    /// The server dropped the wait after `CANCEL_WAIT` (torch's `WAIT_CANCELED`).
    Canceled,
}

/// One request, built argument by argument.
pub struct RequestBuf(Vec<u8>);

impl RequestBuf {
    pub fn new(query: QueryType) -> Self {
        Self(vec![query as u8])
    }

    pub fn u32(mut self, v: u32) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn i64(mut self, v: i64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    pub fn u64(mut self, v: u64) -> Self {
        self.0.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A key or a value: `u64` length, then the bytes.
    pub fn bytes(mut self, b: &[u8]) -> Self {
        self = self.u64(b.len() as u64);
        self.0.extend_from_slice(b);
        self
    }

    /// A key count, then the keys (`CHECK`, `WAIT`).
    pub fn keys<K: AsRef<str>>(mut self, keys: &[K]) -> Self {
        self = self.u64(keys.len() as u64);
        for k in keys {
            self = self.bytes(k.as_ref().as_bytes());
        }
        self
    }

    pub fn finish(self) -> Vec<u8> {
        self.0
    }
}

/// The handshake: `VALIDATE` with the magic, then `PING` with `nonce`, in one write. Torch's own
/// client does the same; the server answers only the ping, so its echo is what proves that a
/// c10d store is listening.
pub fn handshake(nonce: u32) -> Vec<u8> {
    let mut out = RequestBuf::new(QueryType::Validate)
        .u32(VALIDATION_MAGIC)
        .finish();
    out.extend(RequestBuf::new(QueryType::Ping).u32(nonce).finish());
    out
}

/// Decodes the `CHECK` reply.
pub fn decode_check(byte: u8) -> Result<bool, WireError> {
    match byte {
        CHECK_READY => Ok(true),
        CHECK_NOT_READY => Ok(false),
        code => Err(WireError::UnknownCode {
            what: "c10d CHECK reply",
            code,
        }),
    }
}

/// Decodes a `WAIT` or `CANCEL_WAIT` reply.
pub fn decode_wait(byte: u8) -> Result<WaitReply, WireError> {
    match byte {
        0 => Ok(WaitReply::StopWaiting),
        1 => Ok(WaitReply::Canceled),
        code => Err(WireError::UnknownCode {
            what: "c10d WAIT reply",
            code,
        }),
    }
}

/// Checks the length header of a bytes reply against [`MAX_REPLY_LEN`].
pub fn decode_len(header: [u8; 8]) -> Result<usize, WireError> {
    let len = u64::from_le_bytes(header);
    match usize::try_from(len) {
        Ok(n) if n <= MAX_REPLY_LEN => Ok(n),
        _ => Err(WireError::TooLarge {
            len: usize::try_from(len).unwrap_or(usize::MAX),
            max: MAX_REPLY_LEN,
        }),
    }
}

/// Checks the ping's echo.
pub fn check_echo(sent: u32, echoed: [u8; 4]) -> Result<(), WireError> {
    let found = u32::from_le_bytes(echoed);
    if found == sent {
        Ok(())
    } else {
        Err(WireError::BadMagic {
            found,
            expected: sent,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    #[test]
    fn the_handshake_is_what_torch_2_15_sends() {
        // Recorded from `torch.distributed.TCPStore(..., is_master=False)` of torch 2.15,
        // whose ping nonce that time was 0x3366.
        assert_eq!(hex(&handshake(0x3366)), "00cef7853c0d66330000");
    }

    #[test]
    fn set_and_check_are_what_torch_2_15_sends() {
        // Recorded from torch 2.15's `store.set("ab", b"xyz")` then `store.check(["ab"])`
        // (its client puts "/" before every key).
        let set = RequestBuf::new(QueryType::Set)
            .bytes(b"/ab")
            .bytes(b"xyz")
            .finish();
        let check = RequestBuf::new(QueryType::Check).keys(&["/ab"]).finish();
        assert_eq!(
            hex(&[set, check].concat()),
            "0103000000000000002f6162030000000000000078797a05010000000000000003000000000000002f6162"
        );
    }

    #[test]
    fn add_carries_a_signed_delta() {
        let add = RequestBuf::new(QueryType::Add).bytes(b"k").i64(-2).finish();
        assert_eq!(hex(&add), "0401000000000000006bfeffffffffffffff");
    }

    #[test]
    fn replies_are_checked() {
        assert_eq!(decode_check(0), Ok(true));
        assert_eq!(decode_check(1), Ok(false));
        assert!(decode_check(7).is_err());
        assert_eq!(decode_wait(0), Ok(WaitReply::StopWaiting));
        assert_eq!(decode_wait(1), Ok(WaitReply::Canceled));
        assert!(matches!(
            decode_wait(b'H'),
            Err(WireError::UnknownCode { code: b'H', .. })
        ));
        assert_eq!(decode_len(5u64.to_le_bytes()), Ok(5));
        assert!(matches!(
            decode_len(u64::MAX.to_le_bytes()),
            Err(WireError::TooLarge { .. })
        ));
        assert!(check_echo(7, 7u32.to_le_bytes()).is_ok());
        let err = check_echo(7, *b"HTTP").unwrap_err();
        assert!(err.to_string().contains("does not speak"), "{err}");
    }
}
