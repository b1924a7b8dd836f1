//! Reading and writing whole frames on a blocking socket (the I/O half of [`super::wire`]).

use std::io::{self, Read, Write};
use std::net::TcpStream;

use super::wire::{decode_frame_len, MAX_FRAME};
use crate::error::WireError;

/// Why a frame could not be read.
#[derive(Debug)]
pub(crate) enum FrameError {
    /// The socket failed, timed out, or the peer closed it (EOF mid-frame becomes
    /// `UnexpectedEof`, "connection reset by peer" in spirit).
    Io(io::Error),
    /// The bytes are not a frame of this protocol.
    Wire(WireError),
}

/// Reads one frame's payload. The length is checked against [`MAX_FRAME`] before allocating.
pub(crate) fn read_frame(stream: &mut TcpStream) -> Result<Vec<u8>, FrameError> {
    let mut header = [0u8; 4];
    stream.read_exact(&mut header).map_err(FrameError::Io)?;
    let len = decode_frame_len(header).map_err(FrameError::Wire)?;
    debug_assert!(len <= MAX_FRAME);
    let mut payload = vec![0u8; len];
    stream.read_exact(&mut payload).map_err(FrameError::Io)?;
    Ok(payload)
}

/// Writes an already encoded frame.
pub(crate) fn write_frame(stream: &mut TcpStream, frame: &[u8]) -> io::Result<()> {
    stream.write_all(frame)?;
    stream.flush()
}

/// True for the errors a socket read/write timeout produces.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}
