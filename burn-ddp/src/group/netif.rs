//! Which network interface carries an address (for the set-up log: "rank 3 listens on
//! 10.0.0.7 (eth1)"), so a user sees at once when ranks picked the wrong network.

use std::ffi::CStr;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The name of the local interface that has `ip`, if any (`lo` for loopback).
pub fn interface_of(ip: IpAddr) -> Option<String> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a pointer to a list it allocates; on success we walk it and
    // free it exactly once below.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return None;
    }
    let mut found = None;
    let mut node = list;
    while !node.is_null() {
        // SAFETY: `node` is a non-null element of the list getifaddrs returned, alive until
        // freeifaddrs; its fields are valid for reading, and `ifa_addr` (when non-null) points
        // to a sockaddr whose family says which concrete type it is.
        let entry = unsafe { &*node };
        if !entry.ifa_addr.is_null() && !entry.ifa_name.is_null() {
            // SAFETY: `ifa_addr` is non-null (checked above) and points to a sockaddr owned by
            // the list; every sockaddr starts with its family field.
            let family = unsafe { (*entry.ifa_addr).sa_family } as libc::c_int;
            let addr = match family {
                libc::AF_INET => {
                    // SAFETY: the family is AF_INET, so the sockaddr is a sockaddr_in.
                    let sin = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in) };
                    Some(IpAddr::V4(Ipv4Addr::from(u32::from_be(
                        sin.sin_addr.s_addr,
                    ))))
                }
                libc::AF_INET6 => {
                    // SAFETY: the family is AF_INET6, so the sockaddr is a sockaddr_in6.
                    let sin6 = unsafe { &*(entry.ifa_addr as *const libc::sockaddr_in6) };
                    Some(IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr)))
                }
                _ => None,
            };
            if addr == Some(ip) {
                // SAFETY: ifa_name is a NUL-terminated string owned by the list.
                found = Some(
                    unsafe { CStr::from_ptr(entry.ifa_name) }
                        .to_string_lossy()
                        .into_owned(),
                );
                break;
            }
        }
        node = entry.ifa_next;
    }
    // SAFETY: `list` came from a successful getifaddrs and is freed once; no reference into it
    // outlives this call (`found` owns its copy of the name).
    unsafe { libc::freeifaddrs(list) };
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_and_a_foreign_address_is_not() {
        assert!(interface_of(IpAddr::V4(Ipv4Addr::LOCALHOST)).is_some());
        assert_eq!(
            interface_of(IpAddr::V4(Ipv4Addr::new(192, 0, 2, 123))),
            None
        );
    }
}
