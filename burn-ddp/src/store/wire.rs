//! The store's wire protocol: pure encoding and decoding, no I/O.
//!
//! Every message is a frame: a little-endian `u32` payload length, then the payload. A payload
//! starts with a one-byte code, followed by the fields of that message; strings and byte strings
//! are a `u32` length and the bytes. Frames longer than [`MAX_FRAME`] are refused before any
//! allocation, so a hostile or confused peer cannot make the server allocate gigabytes.

use std::time::Duration;

use crate::error::WireError;

/// Largest payload accepted in either direction (values are addresses, ids, small blobs).
pub const MAX_FRAME: usize = 16 << 20;

/// First bytes of the client's hello, so a stray client speaking another protocol is recognised.
pub const MAGIC: u32 = 0x4444_5053; // "DDPS"

/// A client's request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// The first frame on every connection: protocol magic and the job's token.
    Hello { magic: u32, token: String },
    /// Stores `value` under `key`, replacing any previous value and waking waiters.
    Set { key: String, value: Vec<u8> },
    /// Returns the value of `key`, waiting up to `timeout` for it to be set.
    Get { key: String, timeout: Duration },
    /// Adds `delta` to the counter under `key` (absent counts as 0) and returns the new value.
    Add { key: String, delta: i64 },
    /// Waits up to `timeout` until every key is set.
    Wait {
        keys: Vec<String>,
        timeout: Duration,
    },
    /// Returns whether every key is set, without waiting.
    Check { keys: Vec<String> },
    /// Removes `key`; returns whether it was present.
    Delete { key: String },
}

/// The server's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Response {
    Ok,
    Value(Vec<u8>),
    Counter(i64),
    Bool(bool),
    /// The wait ran out; the keys that were still missing.
    TimedOut {
        missing: Vec<String>,
    },
    /// The request was refused (bad token, bad key, ...).
    Error(String),
}

mod code {
    pub const HELLO: u8 = 1;
    pub const SET: u8 = 2;
    pub const GET: u8 = 3;
    pub const ADD: u8 = 4;
    pub const WAIT: u8 = 5;
    pub const CHECK: u8 = 6;
    pub const DELETE: u8 = 7;

    pub const OK: u8 = 100;
    pub const VALUE: u8 = 101;
    pub const COUNTER: u8 = 102;
    pub const BOOL: u8 = 103;
    pub const TIMED_OUT: u8 = 104;
    pub const ERROR: u8 = 105;
}

/// Parses the 4-byte frame header; refuses lengths over [`MAX_FRAME`].
pub fn decode_frame_len(header: [u8; 4]) -> Result<usize, WireError> {
    let len = u32::from_le_bytes(header) as usize;
    if len > MAX_FRAME {
        return Err(WireError::TooLarge {
            len,
            max: MAX_FRAME,
        });
    }
    Ok(len)
}

/// A whole frame (header + payload) for `request`.
pub fn encode_request(request: &Request) -> Vec<u8> {
    let mut w = Writer::frame();
    match request {
        Request::Hello { magic, token } => {
            w.u8(code::HELLO);
            w.u32(*magic);
            w.str(token);
        }
        Request::Set { key, value } => {
            w.u8(code::SET);
            w.str(key);
            w.bytes(value);
        }
        Request::Get { key, timeout } => {
            w.u8(code::GET);
            w.str(key);
            w.duration(*timeout);
        }
        Request::Add { key, delta } => {
            w.u8(code::ADD);
            w.str(key);
            w.u64(*delta as u64);
        }
        Request::Wait { keys, timeout } => {
            w.u8(code::WAIT);
            w.strs(keys);
            w.duration(*timeout);
        }
        Request::Check { keys } => {
            w.u8(code::CHECK);
            w.strs(keys);
        }
        Request::Delete { key } => {
            w.u8(code::DELETE);
            w.str(key);
        }
    }
    w.finish()
}

/// Decodes a request payload (the bytes after the frame header).
pub fn decode_request(payload: &[u8]) -> Result<Request, WireError> {
    let mut r = Reader::new(payload);
    let request = match r.u8("request code")? {
        code::HELLO => Request::Hello {
            magic: r.u32("magic")?,
            token: r.str("token")?,
        },
        code::SET => Request::Set {
            key: r.str("key")?,
            value: r.bytes("value")?.to_vec(),
        },
        code::GET => Request::Get {
            key: r.str("key")?,
            timeout: r.duration()?,
        },
        code::ADD => Request::Add {
            key: r.str("key")?,
            delta: r.u64("delta")? as i64,
        },
        code::WAIT => Request::Wait {
            keys: r.strs()?,
            timeout: r.duration()?,
        },
        code::CHECK => Request::Check { keys: r.strs()? },
        code::DELETE => Request::Delete { key: r.str("key")? },
        other => {
            return Err(WireError::UnknownCode {
                what: "request",
                code: other,
            })
        }
    };
    r.finish()?;
    Ok(request)
}

/// A whole frame (header + payload) for `response`.
pub fn encode_response(response: &Response) -> Vec<u8> {
    let mut w = Writer::frame();
    match response {
        Response::Ok => w.u8(code::OK),
        Response::Value(v) => {
            w.u8(code::VALUE);
            w.bytes(v);
        }
        Response::Counter(c) => {
            w.u8(code::COUNTER);
            w.u64(*c as u64);
        }
        Response::Bool(b) => {
            w.u8(code::BOOL);
            w.u8(u8::from(*b));
        }
        Response::TimedOut { missing } => {
            w.u8(code::TIMED_OUT);
            w.strs(missing);
        }
        Response::Error(message) => {
            w.u8(code::ERROR);
            w.str(message);
        }
    }
    w.finish()
}

/// Decodes a response payload (the bytes after the frame header).
pub fn decode_response(payload: &[u8]) -> Result<Response, WireError> {
    let mut r = Reader::new(payload);
    let response = match r.u8("response code")? {
        code::OK => Response::Ok,
        code::VALUE => Response::Value(r.bytes("value")?.to_vec()),
        code::COUNTER => Response::Counter(r.u64("counter")? as i64),
        code::BOOL => Response::Bool(r.u8("bool")? != 0),
        code::TIMED_OUT => Response::TimedOut { missing: r.strs()? },
        code::ERROR => Response::Error(r.str("error message")?),
        other => {
            return Err(WireError::UnknownCode {
                what: "response",
                code: other,
            })
        }
    };
    r.finish()?;
    Ok(response)
}

/// Appends fields to a frame whose length header is filled in by [`Writer::finish`].
struct Writer(Vec<u8>);

impl Writer {
    fn frame() -> Self {
        Writer(vec![0; 4])
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn duration(&mut self, d: Duration) {
        self.u64(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
    }
    fn bytes(&mut self, v: &[u8]) {
        self.u32(v.len() as u32);
        self.0.extend_from_slice(v);
    }
    fn str(&mut self, s: &str) {
        self.bytes(s.as_bytes());
    }
    fn strs(&mut self, v: &[String]) {
        self.u32(v.len() as u32);
        for s in v {
            self.str(s);
        }
    }
    fn finish(mut self) -> Vec<u8> {
        let len = (self.0.len() - 4) as u32;
        self.0[..4].copy_from_slice(&len.to_le_bytes());
        self.0
    }
}

/// Bounds-checked cursor over a payload: every read says what it was reading when it runs out.
struct Reader<'a> {
    buf: &'a [u8],
}

impl<'a> Reader<'a> {
    fn new(buf: &'a [u8]) -> Self {
        Self { buf }
    }
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                what,
                needed: n - self.buf.len(),
            });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }
    fn u8(&mut self, what: &'static str) -> Result<u8, WireError> {
        Ok(self.take(1, what)?[0])
    }
    fn u32(&mut self, what: &'static str) -> Result<u32, WireError> {
        let b = self.take(4, what)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    fn u64(&mut self, what: &'static str) -> Result<u64, WireError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8, what)?);
        Ok(u64::from_le_bytes(a))
    }
    fn duration(&mut self) -> Result<Duration, WireError> {
        Ok(Duration::from_millis(self.u64("timeout")?))
    }
    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], WireError> {
        let len = self.u32(what)? as usize;
        self.take(len, what)
    }
    fn str(&mut self, what: &'static str) -> Result<String, WireError> {
        let b = self.bytes(what)?;
        String::from_utf8(b.to_vec()).map_err(|_| WireError::BadUtf8 { what })
    }
    fn strs(&mut self) -> Result<Vec<String>, WireError> {
        let n = self.u32("key count")? as usize;
        // Each key needs at least its 4-byte length: refuse counts the payload cannot hold
        // before reserving memory for them.
        if n > self.buf.len() / 4 {
            return Err(WireError::Truncated {
                what: "keys",
                needed: n * 4 - self.buf.len(),
            });
        }
        (0..n).map(|_| self.str("key")).collect()
    }
    fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes {
                extra: self.buf.len(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Hello {
                magic: MAGIC,
                token: "tok".into(),
            },
            Request::Set {
                key: "k".into(),
                value: vec![1, 2, 3],
            },
            Request::Get {
                key: "k".into(),
                timeout: Duration::from_millis(1500),
            },
            Request::Add {
                key: "c".into(),
                delta: -7,
            },
            Request::Wait {
                keys: vec!["a".into(), "b".into()],
                timeout: Duration::from_secs(3),
            },
            Request::Check { keys: vec![] },
            Request::Delete { key: "k".into() },
        ]
    }

    #[test]
    fn requests_round_trip() {
        for req in all_requests() {
            let frame = encode_request(&req);
            let len = decode_frame_len([frame[0], frame[1], frame[2], frame[3]]).unwrap();
            assert_eq!(len, frame.len() - 4);
            assert_eq!(decode_request(&frame[4..]).unwrap(), req);
        }
    }

    #[test]
    fn responses_round_trip() {
        for resp in [
            Response::Ok,
            Response::Value(vec![9; 10]),
            Response::Counter(-3),
            Response::Bool(true),
            Response::TimedOut {
                missing: vec!["x".into()],
            },
            Response::Error("no".into()),
        ] {
            let frame = encode_response(&resp);
            assert_eq!(decode_response(&frame[4..]).unwrap(), resp);
        }
    }

    #[test]
    fn every_truncation_is_an_error_not_a_panic() {
        for req in all_requests() {
            let frame = encode_request(&req);
            for cut in 0..frame.len() - 4 {
                assert!(
                    decode_request(&frame[4..4 + cut]).is_err(),
                    "{req:?} cut at {cut}"
                );
            }
        }
    }

    #[test]
    fn oversized_and_unknown_frames_are_refused() {
        assert!(matches!(
            decode_frame_len((MAX_FRAME as u32 + 1).to_le_bytes()),
            Err(WireError::TooLarge { .. })
        ));
        assert!(matches!(
            decode_request(&[200]),
            Err(WireError::UnknownCode { .. })
        ));
        // A key count far beyond what the payload holds is refused without allocating.
        let mut p = vec![code::CHECK];
        p.extend_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode_request(&p),
            Err(WireError::Truncated { .. })
        ));
        let mut frame = encode_request(&Request::Delete { key: "k".into() });
        frame.push(0);
        assert!(matches!(
            decode_request(&frame[4..]),
            Err(WireError::TrailingBytes { extra: 1 })
        ));
    }

    #[test]
    fn random_bytes_never_panic() {
        // A small deterministic generator: the property is "no panic", whatever the bytes.
        let mut state = 0x1234_5678_9abc_def0u64;
        for _ in 0..20_000 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let len = (state % 64) as usize;
            let bytes: Vec<u8> = (0..len)
                .map(|i| (state.rotate_left(i as u32 * 8) & 0xff) as u8)
                .collect();
            let _ = decode_request(&bytes);
            let _ = decode_response(&bytes);
        }
    }
}
