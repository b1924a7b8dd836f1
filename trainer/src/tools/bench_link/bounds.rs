//! What a step can cost at best on a link of known bandwidth: the two bounds of the
//! `bench-link` table, and the link-rate arithmetic (pure).
//!
//! A data-parallel step is local work (data, forward + backward, optimizer) plus one ring
//! all-reduce of every gradient. On a link whose all-reduce bus bandwidth is `busbw` bytes/s, the
//! all-reduce of `payload` bytes over `n` ranks takes `payload x 2(n-1)/n / busbw` (each rank
//! sends and receives that much: reduce-scatter, then all-gather). Then:
//! - **no overlap**: `step = work + comm` — the work and the wire strictly one after the other;
//! - **full overlap**: `step = max(work, comm)` — the wire busy while the CPU works.
//!
//! A run's samples/s divided by each bound's says how much of the link it uses.

use std::fmt;

/// A link rate as `tc` takes it (`1gbit`, `500mbit`, `10gbit`), in bits per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LinkRate {
    pub bits_per_sec: u64,
}

impl LinkRate {
    /// Parses `<number><unit>` with unit `kbit`, `mbit` or `gbit` (decimal, as `tc` reads
    /// them); the number may have a fraction (`2.5gbit`).
    pub fn parse(text: &str) -> Result<Self, String> {
        let t = text.trim().to_ascii_lowercase();
        let units = [("gbit", 1e9), ("mbit", 1e6), ("kbit", 1e3)];
        let Some((number, scale)) = units
            .iter()
            .find_map(|(unit, scale)| t.strip_suffix(unit).map(|n| (n, *scale)))
        else {
            return Err(format!(
                "link rate {text:?}: expected a number with kbit, mbit or gbit (e.g. 1gbit)"
            ));
        };
        match number.trim().parse::<f64>() {
            Ok(x) if x.is_finite() && x > 0.0 && x * scale >= 8e3 => Ok(Self {
                bits_per_sec: (x * scale).round() as u64,
            }),
            _ => Err(format!(
                "link rate {text:?}: the number must be positive and at least 8kbit"
            )),
        }
    }

    /// Bytes per second.
    pub fn bytes_per_sec(self) -> f64 {
        self.bits_per_sec as f64 / 8.0
    }

    /// The rate as `tc` reads it (`1000000000bit`).
    pub fn tc(self) -> String {
        format!("{}bit", self.bits_per_sec)
    }

    /// The token bucket's burst for `tbf`: 2 ms at the rate, at least 256 KiB (a burst smaller
    /// than `rate / HZ` caps the rate below the setting; 64 KiB GSO packets must fit).
    pub fn tbf_burst_bytes(self) -> u64 {
        ((self.bytes_per_sec() * 2e-3) as u64).max(256 << 10)
    }
}

impl fmt::Display for LinkRate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.bits_per_sec as f64;
        if b >= 1e9 {
            write!(f, "{} Gbit/s", b / 1e9)
        } else if b >= 1e6 {
            write!(f, "{} Mbit/s", b / 1e6)
        } else {
            write!(f, "{} kbit/s", b / 1e3)
        }
    }
}

/// Bytes each rank sends (and receives) in a ring all-reduce of `payload` bytes over `world`
/// ranks: `2 (world - 1) / world x payload` (0 for one rank).
pub fn ring_bytes_per_rank(payload: f64, world: usize) -> f64 {
    if world <= 1 {
        return 0.0;
    }
    payload * 2.0 * (world as f64 - 1.0) / world as f64
}

/// The inputs of the bounds, all measured or known for one configuration.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepModel {
    /// Seconds of local work per step (data + compute + optimizer): everything but the sync.
    pub work_s: f64,
    /// Bytes of gradients all-reduced per step (4 per parameter, 2 when compressed).
    pub payload_bytes: f64,
    /// Ranks in the ring.
    pub world: usize,
    /// Measured all-reduce bus bandwidth of the link, bytes/s.
    pub busbw: f64,
    /// Samples per step over all ranks (per-rank batch x world).
    pub samples_per_step: f64,
}

/// Best throughputs, samples/s.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bounds {
    /// Seconds of communication per step at the measured bandwidth.
    pub comm_s: f64,
    /// `samples / (work + comm)`.
    pub no_overlap: f64,
    /// `samples / max(work, comm)`.
    pub full_overlap: f64,
}

impl StepModel {
    /// The two bounds of the module docs.
    pub fn bounds(&self) -> Bounds {
        let comm_s = ring_bytes_per_rank(self.payload_bytes, self.world) / self.busbw;
        Bounds {
            comm_s,
            no_overlap: self.samples_per_step / (self.work_s + comm_s),
            full_overlap: self.samples_per_step / self.work_s.max(comm_s),
        }
    }
}

/// The fraction of a step's communication (`comm_s`, at the measured bandwidth) hidden under
/// its local work: `1 - (step - work) / comm`, within [0, 1] — what the step takes beyond its
/// work is the communication that was not hidden. The same formula for any framework, from
/// its step time and its step time without communication.
pub fn hidden_fraction(step_s: f64, work_s: f64, comm_s: f64) -> f64 {
    if comm_s.is_nan() || comm_s <= 0.0 {
        return 0.0;
    }
    (1.0 - (step_s - work_s) / comm_s).clamp(0.0, 1.0)
}

/// Bus bandwidth (bytes/s) from one all-reduce of `bytes` taking `seconds` on `world` ranks, as
/// nccl-tests defines it: `bytes / seconds x 2 (world - 1) / world`.
pub fn busbw(bytes: f64, seconds: f64, world: usize) -> f64 {
    ring_bytes_per_rank(bytes, world) / seconds
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_parse_as_tc_reads_them() {
        assert_eq!(
            LinkRate::parse("1gbit").unwrap().bits_per_sec,
            1_000_000_000
        );
        assert_eq!(
            LinkRate::parse("10Gbit").unwrap().bits_per_sec,
            10_000_000_000
        );
        assert_eq!(
            LinkRate::parse("2.5gbit").unwrap().bits_per_sec,
            2_500_000_000
        );
        assert_eq!(LinkRate::parse(" 500mbit ").unwrap().tc(), "500000000bit");
        assert_eq!(LinkRate::parse("1gbit").unwrap().to_string(), "1 Gbit/s");
        assert_eq!(
            LinkRate::parse("100mbit").unwrap().to_string(),
            "100 Mbit/s"
        );
        for bad in [
            "1g",
            "gbit",
            "-1gbit",
            "0mbit",
            "1kbit",
            "nanmbit",
            "1 gigabit",
        ] {
            assert!(LinkRate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn tbf_burst_is_two_milliseconds_but_at_least_256_kib() {
        assert_eq!(
            LinkRate::parse("1gbit").unwrap().tbf_burst_bytes(),
            256 << 10
        );
        assert_eq!(
            LinkRate::parse("10gbit").unwrap().tbf_burst_bytes(),
            2_500_000
        );
    }

    #[test]
    fn the_issue_s_numbers() {
        // Issue #16: 1.86 M parameters, 2 ranks of batch 64, 14 ms of work, 0.119 GB/s busbw.
        let f32_model = StepModel {
            work_s: 0.014,
            payload_bytes: 7.46e6,
            world: 2,
            busbw: 0.119e9,
            samples_per_step: 128.0,
        };
        let b = f32_model.bounds();
        assert!((b.comm_s - 0.0627).abs() < 1e-3, "{b:?}");
        assert!((b.no_overlap - 1670.0).abs() < 10.0, "{b:?}");
        assert!((b.full_overlap - 2040.0).abs() < 10.0, "{b:?}");
        let bf16 = StepModel {
            payload_bytes: 3.73e6,
            ..f32_model
        }
        .bounds();
        assert!((bf16.no_overlap - 2830.0).abs() < 15.0, "{bf16:?}");
        // Communication (31 ms) longer than work: full overlap is bound by the wire.
        assert!((bf16.full_overlap - 4090.0).abs() < 15.0, "{bf16:?}");
    }

    #[test]
    fn hidden_is_the_communication_the_step_did_not_wait_for() {
        // 10 ms of work, 40 ms of wire: a 50 ms step hid nothing, a 30 ms one half of it.
        assert_eq!(hidden_fraction(0.050, 0.010, 0.040), 0.0);
        assert!((hidden_fraction(0.030, 0.010, 0.040) - 0.5).abs() < 1e-12);
        assert_eq!(hidden_fraction(0.010, 0.010, 0.040), 1.0);
        // Slower than work + wire, or no wire at all: nothing hidden.
        assert_eq!(hidden_fraction(0.080, 0.010, 0.040), 0.0);
        assert_eq!(hidden_fraction(0.080, 0.010, 0.0), 0.0);
    }

    #[test]
    fn ring_traffic_and_busbw() {
        assert_eq!(ring_bytes_per_rank(100.0, 1), 0.0);
        assert_eq!(ring_bytes_per_rank(100.0, 2), 100.0);
        assert_eq!(ring_bytes_per_rank(100.0, 4), 150.0);
        assert_eq!(busbw(8.0, 2.0, 2), 4.0);
    }
}
