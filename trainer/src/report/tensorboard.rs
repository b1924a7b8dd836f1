//! TensorBoard event files (`output.tensorboard = true`; cargo feature `tensorboard`), so users keep the viewer they know:
//! `tensorboard --logdir runs/NAME/tensorboard`.
//!
//! An event file is a sequence of TFRecords (length, masked CRC-32C of the length, payload,
//! masked CRC-32C of the payload), each payload a `tensorflow.Event` protobuf; the first
//! event names the file version, the others carry scalar summaries. Only the few fields
//! TensorBoard needs for scalars are declared here (with `prost`). Each process start writes
//! a new file; TensorBoard merges the files of a directory, so a resumed run continues its
//! curves.

use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

use crate::report::record::Record;
use crate::report::timing::Phase;

/// `tensorflow.Event`, the fields used for scalars.
#[derive(Clone, PartialEq, Message)]
struct Event {
    #[prost(double, tag = "1")]
    wall_time: f64,
    #[prost(int64, tag = "2")]
    step: i64,
    #[prost(string, optional, tag = "3")]
    file_version: Option<String>,
    #[prost(message, optional, tag = "5")]
    summary: Option<Summary>,
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value` with a `simple_value`.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    #[prost(string, tag = "1")]
    tag: String,
    #[prost(float, optional, tag = "2")]
    simple_value: Option<f32>,
}

/// One TensorBoard event file, appended to as the run goes. Rank 0 only.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir` and a new event file in it, named as TensorBoard expects
    /// (`events.out.tfevents.<seconds>.<host>.<pid>`).
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        fs::create_dir_all(dir)?;
        let now = unix_time();
        let host = fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|h| h.trim().to_string())
            .unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now as u64,
            std::process::id()
        ));
        let mut writer = Self {
            file: BufWriter::new(File::create(&path)?),
            path,
        };
        writer.write_event(&Event {
            wall_time: now,
            step: 0,
            file_version: Some("brain.Event:2".into()),
            summary: None,
        })?;
        Ok(writer)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes the scalars of one `metrics.jsonl` record (none for records without any).
    pub fn record(&mut self, record: &Record) -> std::io::Result<()> {
        let Some((step, values)) = scalars(record) else {
            return Ok(());
        };
        let value = values
            .into_iter()
            .filter(|(_, v)| v.is_finite())
            .map(|(tag, v)| SummaryValue {
                tag,
                simple_value: Some(v as f32),
            })
            .collect();
        self.write_event(&Event {
            wall_time: unix_time(),
            step: step as i64,
            file_version: None,
            summary: Some(Summary { value }),
        })
    }

    fn write_event(&mut self, event: &Event) -> std::io::Result<()> {
        self.file.write_all(&tf_record(&event.encode_to_vec()))?;
        self.file.flush()
    }
}

/// The scalars TensorBoard shows for a record, with the step they belong to: training
/// metrics, learning rate and throughput, the step time by phase (median over ranks, and the
/// slowest rank's step), validation metrics, and the world size after the job re-formed.
pub fn scalars(record: &Record) -> Option<(usize, Vec<(String, f64)>)> {
    match record {
        Record::Train {
            step,
            lr,
            samples_per_sec,
            metrics,
            time,
            ..
        } => {
            let mut values: Vec<(String, f64)> = metrics
                .iter()
                .map(|(name, v)| (format!("train/{name}"), *v))
                .collect();
            values.push(("train/learning_rate".into(), *lr));
            values.push(("train/samples_per_sec".into(), *samples_per_sec));
            for phase in Phase::ALL {
                values.push((
                    format!("step_time_ms/{}", phase.name()),
                    time.phase(phase).median * 1e3,
                ));
            }
            values.push((
                "step_time_ms/step_max_over_ranks".into(),
                time.step.max * 1e3,
            ));
            Some((*step, values))
        }
        Record::Valid { step, metrics, .. } => Some((
            *step,
            metrics
                .iter()
                .map(|(name, v)| (format!("valid/{name}"), *v))
                .collect(),
        )),
        Record::Regroup {
            step,
            world_size,
            recovery_secs,
            ..
        } => Some((
            *step,
            vec![
                ("membership/world_size".into(), *world_size as f64),
                ("membership/recovery_secs".into(), *recovery_secs),
            ],
        )),
        Record::Start { .. } | Record::Finish { .. } => None,
    }
}

/// One TFRecord: little-endian length, its masked CRC, the data, the data's masked CRC.
fn tf_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TFRecord's CRC-32C, rotated and offset so that data holding CRCs does not checksum to
/// patterns.
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::timing::{RankTimes, StepTime};

    #[test]
    fn crc32c_is_castagnoli_and_masked_as_tfrecord_says() {
        // CRC-32C check value of "123456789" (RFC 3720 appendix).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(
            masked_crc(b"123456789"),
            0xe306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8)
        );
    }

    #[test]
    fn a_record_frames_its_payload() {
        let framed = tf_record(b"abc");
        assert_eq!(framed.len(), 8 + 4 + 3 + 4);
        assert_eq!(&framed[..8], &3u64.to_le_bytes());
        assert_eq!(&framed[12..15], b"abc");
    }

    #[test]
    fn a_train_line_gives_metrics_rate_and_step_times() {
        let ranks = [RankTimes {
            phases: [0.001, 0.004, 0.002, 0.0005, 0.0],
            step: 0.008,
        }];
        let record = Record::Train {
            epoch: 0,
            step: 30,
            lr: 0.1,
            samples_per_sec: 900.0,
            world_size: 1,
            metrics: [("Loss".to_string(), 0.5)].into(),
            time: StepTime::across_ranks(&ranks),
        };
        let (step, values) = scalars(&record).expect("scalars");
        assert_eq!(step, 30);
        let get = |tag: &str| values.iter().find(|(t, _)| t == tag).map(|(_, v)| *v);
        assert_eq!(get("train/Loss"), Some(0.5));
        assert_eq!(get("train/learning_rate"), Some(0.1));
        assert_eq!(get("step_time_ms/compute"), Some(4.0));
    }
}
