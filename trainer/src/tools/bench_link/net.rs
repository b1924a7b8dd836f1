//! [`Network`]: "machines" on one host — a network namespace per node, each joined to a switch
//! (a bridge in a namespace of its own) by a veth pair shaped with `tc` — removed on drop.
//!
//! ```text
//!   node 0 (ns ddpl<pid>n0, 10.78.0.1)           switch (ns ddpl<pid>sw)
//!     dl<pid>n0 ──tbf rate [netem delay]──▶ dl<pid>s0 ─┐
//!               ◀──────────tbf rate──────── dl<pid>s0  ├─ br0
//!   node 1 (ns ddpl<pid>n1, 10.78.0.2)                  │
//!     dl<pid>n1 ──tbf rate [netem delay]──▶ dl<pid>s1 ─┘
//!               ◀──────────tbf rate──────── dl<pid>s1
//! ```
//! Each node's link is shaped in both directions (the egress of both ends of its veth pair), so a
//! node sends and receives at most `rate` at once, like a NIC on a switch. The optional delay is
//! added once per direction between two nodes (on the node's egress).
//!
//! Every namespace name carries this process's id. [`Network::drop`] deletes them (which removes
//! their veths too); [`remove_stale`] deletes those of bench processes that died without doing
//! so (SIGKILL), before a new run creates its own.

use std::process::Command;

use anyhow::{bail, Context};

use super::bounds::LinkRate;
use crate::error::UsageError;

/// How every node's link is shaped.
#[derive(Debug, Clone, Copy)]
pub struct Shaping {
    pub rate: LinkRate,
    /// One-way delay added by `netem`, milliseconds; 0 for none.
    pub delay_ms: f64,
}

/// The namespaces and links of one run; deleted on drop.
#[derive(Debug)]
pub struct Network {
    /// Namespaces created so far (the switch first), deleted in reverse order.
    namespaces: Vec<String>,
    nodes: Vec<Node>,
}

/// One node's namespace, its interface and address.
#[derive(Debug, Clone)]
pub struct Node {
    pub ns: String,
    pub ifname: String,
    pub addr: String,
}

/// The prefix of every namespace this tool creates; the process id follows.
const PREFIX: &str = "ddpl";

/// Fails with a [`UsageError`] (exit code 2) unless this process may create namespaces and
/// shape links: it needs `CAP_NET_ADMIN` and `CAP_SYS_ADMIN` (root), and `ip` and `tc`.
pub fn check_privileges() -> anyhow::Result<()> {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let caps = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    const CAP_NET_ADMIN: u64 = 1 << 12;
    const CAP_SYS_ADMIN: u64 = 1 << 21;
    if caps & (CAP_NET_ADMIN | CAP_SYS_ADMIN) != CAP_NET_ADMIN | CAP_SYS_ADMIN {
        bail!(UsageError(
            "bench-link creates network namespaces and shapes links with tc: it needs root \
             (CAP_NET_ADMIN and CAP_SYS_ADMIN); run it as root, e.g. `sudo trainer bench-link`"
                .into()
        ));
    }
    for tool in ["ip", "tc"] {
        let found = Command::new(tool).arg("-V").output().is_ok();
        if !found {
            bail!(UsageError(format!(
                "bench-link needs `{tool}` (package iproute2) on PATH"
            )));
        }
    }
    Ok(())
}

/// Deletes namespaces left by bench processes that no longer run (killed before their drop).
pub fn remove_stale() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(pid) = name
            .strip_prefix(PREFIX)
            .map(|rest| {
                rest.chars()
                    .take_while(char::is_ascii_digit)
                    .collect::<String>()
            })
            .and_then(|digits| digits.parse::<u32>().ok())
        else {
            continue;
        };
        if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            tracing::info!("removing network namespace {name} left by process {pid}");
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}

impl Network {
    /// Creates `nodes` namespaces on a switch, each link shaped by `shaping` (module docs).
    /// Whatever was created is removed again when a step fails.
    pub fn create(nodes: usize, shaping: Shaping) -> anyhow::Result<Self> {
        let pid = std::process::id();
        let mut net = Network {
            namespaces: Vec::new(),
            nodes: Vec::new(),
        };
        let switch = format!("{PREFIX}{pid}sw");
        ip(&["netns", "add", &switch])?;
        net.namespaces.push(switch.clone());
        ip(&["-n", &switch, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &switch, "link", "set", "br0", "up"])?;
        for i in 0..nodes {
            let node = Node {
                ns: format!("{PREFIX}{pid}n{i}"),
                ifname: format!("dl{pid}n{i}"),
                addr: format!("10.78.0.{}", i + 1),
            };
            let port = format!("dl{pid}s{i}");
            ip(&["netns", "add", &node.ns])?;
            net.namespaces.push(node.ns.clone());
            ip(&[
                "link",
                "add",
                &node.ifname,
                "type",
                "veth",
                "peer",
                "name",
                &port,
            ])?;
            // Moved at once: a veth left in the host namespace would outlive a failure here.
            let moved = ip(&["link", "set", &node.ifname, "netns", &node.ns])
                .and_then(|()| ip(&["link", "set", &port, "netns", &switch]));
            if let Err(e) = moved {
                let _ = ip(&["link", "del", &node.ifname]);
                let _ = ip(&["link", "del", &port]);
                return Err(e);
            }
            ip(&["-n", &switch, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", &switch, "link", "set", &port, "up"])?;
            let cidr = format!("{}/24", node.addr);
            ip(&["-n", &node.ns, "addr", "add", &cidr, "dev", &node.ifname])?;
            ip(&["-n", &node.ns, "link", "set", &node.ifname, "up"])?;
            ip(&["-n", &node.ns, "link", "set", "lo", "up"])?;
            shape(&node.ns, &node.ifname, shaping.rate, shaping.delay_ms)?;
            shape(&switch, &port, shaping.rate, 0.0)?;
            net.nodes.push(node);
        }
        Ok(net)
    }

    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// `program args...` run inside node `node`'s namespace (`ip netns exec`, which execs it:
    /// the child's pid is the program's).
    pub fn command(&self, node: usize, program: &std::path::Path) -> Command {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.nodes[node].ns])
            .arg(program);
        cmd
    }

    /// Bytes node `node` has sent on its link so far (the interface counter: payload, TCP/IP
    /// and Ethernet headers, retransmissions).
    pub fn tx_bytes(&self, node: usize) -> anyhow::Result<u64> {
        let n = &self.nodes[node];
        let out = Command::new("ip")
            .args(["-n", &n.ns, "-s", "-j", "link", "show", "dev", &n.ifname])
            .output()
            .context("cannot run `ip -s link show`")?;
        let json: serde_json::Value = serde_json::from_slice(&out.stdout)
            .with_context(|| format!("`ip -s -j link show` printed no JSON for {}", n.ifname))?;
        json[0]["stats64"]["tx"]["bytes"]
            .as_u64()
            .with_context(|| format!("no tx byte counter for {} in {json}", n.ifname))
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        for ns in self.namespaces.iter().rev() {
            if let Err(e) = ip(&["netns", "del", ns]) {
                eprintln!("bench-link: could not remove network namespace {ns}: {e:#}");
            }
        }
    }
}

/// `tc` on `dev` in `ns`: a token bucket at `rate`, with a `netem` delay under it if asked.
fn shape(ns: &str, dev: &str, rate: LinkRate, delay_ms: f64) -> anyhow::Result<()> {
    let burst = rate.tbf_burst_bytes().to_string();
    let tc_rate = rate.tc();
    tc(&[
        "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "tbf", "rate", &tc_rate,
        "burst", &burst, "latency", "50ms",
    ])?;
    if delay_ms > 0.0 {
        let delay = format!("{delay_ms}ms");
        tc(&[
            "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "netem",
            "delay", &delay, "limit", "100000",
        ])
        .context(
            "adding a delay needs the kernel's netem qdisc (module sch_netem); leave out \
             --delay-ms where it is missing",
        )?;
    }
    Ok(())
}

fn ip(args: &[&str]) -> anyhow::Result<()> {
    run("ip", args)
}

fn tc(args: &[&str]) -> anyhow::Result<()> {
    run("tc", args)
}

fn run(tool: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(tool)
        .args(args)
        .output()
        .with_context(|| format!("cannot run `{tool}`"))?;
    if !out.status.success() {
        bail!(
            "`{tool} {}` failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(())
}
