//! A client of PyTorch's c10d `TCPStore`, the store `torchrun`'s agent hosts on `MASTER_PORT`
//! for its workers (`TORCHELASTIC_USE_AGENT_STORE=True`), so a job under torchrun rendezvous
//! through the agent's store instead of hosting its own.
//!
//! - [`wire`]: the byte layout of torch's protocol (pure encode/decode, checked against bytes
//!   recorded from torch 2.15).
//! - [`client`]: [`C10dStore`], the connection and the [`super::Store`] implementation.
//!
//! Read from torch's `TCPStore.cpp`, `TCPStoreBackend.hpp` and `TCPStoreLibUvBackend.cpp`, and
//! tested against the real server of torch 2.15 (both its libuv and its classic backend). The
//! handshake ends with a `PING`, as torch 2.15's own client does; a server too old to know it
//! closes the connection, which shows as a failed handshake in the connect error.

pub mod client;
pub mod wire;

#[cfg(test)]
mod tests;

pub use client::C10dStore;
