//! The network the ranks meet on: loopback, the route to `MASTER_ADDR`, and the store's port.

use std::net::IpAddr;
use std::time::Duration;

use super::units::plural;
use crate::finding::Finding;

/// A connection to this machine through 127.0.0.1 (its round trip, or why it failed).
pub fn loopback(result: &Result<Duration, String>) -> Finding {
    const CHECK: &str = "loopback";
    match result {
        Ok(rtt) => Finding::ok(
            CHECK,
            format!(
                "127.0.0.1 works (connect and one byte there and back in {} us)",
                rtt.as_micros()
            ),
        ),
        Err(e) => Finding::fail(
            CHECK,
            format!("this machine cannot talk to itself over 127.0.0.1: {e}"),
            "bring the loopback interface up (`ip link set lo up`); in a container or network namespace, check that it has one",
        ),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RouteFacts {
    pub master_addr: String,
    /// The addresses `master_addr` resolves to.
    pub resolved: Result<Vec<IpAddr>, String>,
    /// The local address (and its interface) that reaches the first of them; `None` when it
    /// did not resolve.
    pub route: Option<Result<(IpAddr, Option<String>), String>>,
    /// Whether the first resolved address belongs to this machine.
    pub master_is_here: bool,
    pub nnodes: usize,
    pub node_rank: usize,
}

/// How this machine reaches `MASTER_ADDR`, and whether every node can.
pub fn network(f: &RouteFacts) -> Finding {
    const CHECK: &str = "network";
    let addr = &f.master_addr;
    let ip = match &f.resolved {
        Ok(ips) if !ips.is_empty() => ips[0],
        Ok(_) => {
            return Finding::fail(
                CHECK,
                format!("MASTER_ADDR {addr} resolves to no address"),
                "use an IP address, or a name every node resolves (/etc/hosts, DNS)",
            )
        }
        Err(e) => {
            return Finding::fail(
                CHECK,
                format!("MASTER_ADDR {addr} does not resolve: {e}"),
                "use an IP address, or a name every node resolves (/etc/hosts, DNS); on one machine, 127.0.0.1",
            )
        }
    };
    let shown = if addr == &ip.to_string() {
        addr.clone()
    } else {
        format!("{addr} ({ip})")
    };
    let (source, interface) = match &f.route {
        Some(Ok((source, interface))) => (*source, interface.clone()),
        Some(Err(e)) => {
            return Finding::fail(
                CHECK,
                format!("no route from this machine to MASTER_ADDR {shown}: {e}"),
                format!("check the address, and this machine's routes (`ip route get {ip}`)"),
            )
        }
        None => {
            return Finding::skip(CHECK, format!("no route looked up for {shown}"));
        }
    };
    if f.nnodes > 1 && ip.is_loopback() {
        return Finding::fail(
            CHECK,
            format!(
                "MASTER_ADDR {shown} is a loopback address: the other {} cannot reach it",
                plural(f.nnodes - 1, "node")
            ),
            "set --master-addr (or MASTER_ADDR) to node 0's address on the network all nodes share",
        );
    }
    if f.nnodes > 1 && f.node_rank == 0 && !f.master_is_here {
        return Finding::warn(
            CHECK,
            format!(
                "MASTER_ADDR {shown} is not an address of this machine, but node 0 hosts the store"
            ),
            "run node 0 on the machine MASTER_ADDR names, or set --master-addr to one of this machine's addresses",
        );
    }
    let interface = interface.map_or_else(String::new, |i| format!(" ({i})"));
    Finding::ok(
        CHECK,
        format!(
            "MASTER_ADDR {shown} is reached from {source}{interface}: the ranks here listen there for their ring neighbours"
        ),
    )
}

/// What was tried with the store's port.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PortProbe {
    /// One machine and no port given: the launcher binds port 0 and the OS picks a free one.
    OsPicks,
    /// This machine hosts the store: binding `host:port`, and how it failed.
    Bind {
        host: String,
        result: Result<(), (std::io::ErrorKind, String)>,
    },
    /// Another process hosts the store: connecting to `endpoint`.
    Connect {
        endpoint: String,
        result: Result<(), String>,
    },
}

/// Whether the store's port can be used.
pub fn port(port: u16, probe: &PortProbe) -> Finding {
    const CHECK: &str = "port";
    match probe {
        PortProbe::OsPicks => Finding::ok(
            CHECK,
            "none given: on one machine the launcher lets the OS pick a free port",
        ),
        PortProbe::Bind { host, result: Ok(()) } => Finding::ok(
            CHECK,
            format!("{port} is free on {host}: the rendezvous store can listen there"),
        ),
        PortProbe::Bind {
            host,
            result: Err((std::io::ErrorKind::AddrInUse, _)),
        } => Finding::fail(
            CHECK,
            format!("{port} is in use on {host}: another process listens there"),
            format!(
                "pick another with --master-port or MASTER_PORT (the same on every node), or leave it out on one machine (the launcher then picks a free one); `ss -ltnp 'sport = :{port}'` shows who holds it"
            ),
        ),
        PortProbe::Bind {
            host,
            result: Err((std::io::ErrorKind::PermissionDenied, e)),
        } => Finding::fail(
            CHECK,
            format!("{port} cannot be bound on {host}: {e}"),
            "ports below 1024 need root: pick one from 1024 up with --master-port or MASTER_PORT",
        ),
        PortProbe::Bind {
            host,
            result: Err((_, e)),
        } => Finding::fail(
            CHECK,
            format!("{port} cannot be bound on {host}: {e}"),
            "pick another with --master-port or MASTER_PORT; on several nodes, node 0 must own MASTER_ADDR",
        ),
        PortProbe::Connect {
            endpoint,
            result: Ok(()),
        } => Finding::ok(
            CHECK,
            format!("{endpoint} accepts connections: the rendezvous store is up"),
        ),
        PortProbe::Connect {
            endpoint,
            result: Err(e),
        } => Finding::warn(
            CHECK,
            format!("nothing accepts connections at {endpoint} yet: {e}"),
            format!(
                "start node 0 (or rank 0), which hosts the store: ranks wait for it up to distributed.timeout_secs; if it runs, check firewalls for port {port} between the nodes"
            ),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::finding::Status;
    use std::io::ErrorKind;

    #[test]
    fn port_in_use_names_the_port_and_what_to_do() {
        let busy = port(
            29500,
            &PortProbe::Bind {
                host: "127.0.0.1".into(),
                result: Err((ErrorKind::AddrInUse, "Address in use".into())),
            },
        );
        assert_eq!(busy.status, Status::Fail);
        assert!(busy.detail.contains("29500 is in use"), "{}", busy.detail);
        assert!(busy.advice.unwrap().contains("--master-port"));
        let free = PortProbe::Bind {
            host: "0.0.0.0".into(),
            result: Ok(()),
        };
        assert_eq!(port(29500, &free).status, Status::Ok);
        assert_eq!(port(0, &PortProbe::OsPicks).status, Status::Ok);
        let nobody = PortProbe::Connect {
            endpoint: "10.0.0.1:29500".into(),
            result: Err("refused".into()),
        };
        assert_eq!(port(29500, &nobody).status, Status::Warn);
    }

    fn route(addr: &str, nnodes: usize, here: bool) -> RouteFacts {
        let ip: IpAddr = addr.parse().unwrap();
        RouteFacts {
            master_addr: addr.into(),
            resolved: Ok(vec![ip]),
            route: Some(Ok((ip, Some("eth0".into())))),
            master_is_here: here,
            nnodes,
            node_rank: 0,
        }
    }

    #[test]
    fn several_nodes_need_a_master_address_they_can_reach() {
        assert_eq!(network(&route("127.0.0.1", 1, true)).status, Status::Ok);
        assert_eq!(network(&route("127.0.0.1", 2, true)).status, Status::Fail);
        assert_eq!(network(&route("10.0.0.1", 2, true)).status, Status::Ok);
        assert_eq!(network(&route("10.0.0.1", 2, false)).status, Status::Warn);
        let unresolved = RouteFacts {
            resolved: Err("Name or service not known".into()),
            route: None,
            ..route("10.0.0.1", 1, false)
        };
        let f = network(&unresolved);
        assert_eq!(f.status, Status::Fail);
        assert!(f.detail.contains("does not resolve"), "{}", f.detail);
        let ok = network(&route("10.0.0.1", 2, true));
        assert!(ok.detail.contains("(eth0)"), "{}", ok.detail);
    }
}
