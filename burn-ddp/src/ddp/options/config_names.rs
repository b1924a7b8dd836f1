//! The config names of the two [`DdpOptions`](crate::ddp::DdpOptions) fields that are `Option`s
//! (feature `serde`): serde `with` modules for a field of a config struct, as the trainer's
//! `[distributed]` table uses them. A name that is not one of these is refused naming the
//! ones that are, as serde's derive refuses an unknown variant.
//!
//! | field | names |
//! |---|---|
//! | `compression: Option<HalfFormat>` ([`compression`]) | `"none"`, `"bf16"`, `"fp16"` |
//! | `buffers: Option<BufferSync>` ([`buffers`]) | `"broadcast"` (from rank 0), `"average"`, `"off"` |

/// `Option<HalfFormat>` as `"none"` (f32 on the wire), `"bf16"` or `"fp16"`
/// ([`HalfFormat::name`]).
pub mod compression {
    use serde::de::{Deserialize, Deserializer, Error as _};
    use serde::ser::Serializer;

    use crate::kernels::HalfFormat;

    const NAMES: &[&str] = &["none", "bf16", "fp16"];

    pub fn serialize<S: Serializer>(format: &Option<HalfFormat>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(format.map_or("none", HalfFormat::name))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<HalfFormat>, D::Error> {
        let name = String::deserialize(d)?;
        match name.as_str() {
            "none" => Ok(None),
            _ => [HalfFormat::Bf16, HalfFormat::F16]
                .into_iter()
                .find(|f| f.name() == name)
                .map(Some)
                .ok_or_else(|| D::Error::unknown_variant(&name, NAMES)),
        }
    }
}

/// `Option<BufferSync>` as `"broadcast"` (rank 0's buffers: `Broadcast { root: 0 }`, PyTorch
/// DDP's `broadcast_buffers=True`), `"average"` or `"off"` (each rank keeps its own). A
/// broadcast from another root has no name and does not serialise.
pub mod buffers {
    use serde::de::{Deserialize, Deserializer, Error as _};
    use serde::ser::{Error as _, Serializer};

    use crate::ddp::buffers::BufferSync;

    const NAMES: &[&str] = &["broadcast", "average", "off"];

    pub fn serialize<S: Serializer>(rule: &Option<BufferSync>, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(match rule {
            Some(BufferSync::Broadcast { root: 0 }) => "broadcast",
            Some(BufferSync::Broadcast { root }) => {
                return Err(S::Error::custom(format!(
                    "a broadcast of buffers from rank {root} has no config name (only rank 0's, \"broadcast\")"
                )))
            }
            Some(BufferSync::Average) => "average",
            None => "off",
        })
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<BufferSync>, D::Error> {
        let name = String::deserialize(d)?;
        match name.as_str() {
            "broadcast" => Ok(Some(BufferSync::Broadcast { root: 0 })),
            "average" => Ok(Some(BufferSync::Average)),
            "off" => Ok(None),
            _ => Err(D::Error::unknown_variant(&name, NAMES)),
        }
    }
}

#[cfg(test)]
mod tests {
    //! Read through serde's own value deserializers (the trainer's config tests read and
    //! write them as TOML).
    use serde::de::value::{Error, StrDeserializer};
    use serde::de::{Deserialize, IntoDeserializer};

    use super::{buffers, compression};
    use crate::ddp::buffers::BufferSync;
    use crate::kernels::HalfFormat;

    fn text(name: &str) -> StrDeserializer<'_, Error> {
        name.into_deserializer()
    }

    #[test]
    fn compression_names() {
        assert_eq!(compression::deserialize(text("none")), Ok(None));
        assert_eq!(
            compression::deserialize(text("bf16")),
            Ok(Some(HalfFormat::Bf16))
        );
        assert_eq!(
            compression::deserialize(text("fp16")),
            Ok(Some(HalfFormat::F16))
        );
        let err = compression::deserialize(text("fp8"))
            .unwrap_err()
            .to_string();
        assert_eq!(
            err,
            "unknown variant `fp8`, expected one of `none`, `bf16`, `fp16`"
        );
        // The derive of `HalfFormat` itself uses the same names.
        for format in [HalfFormat::Bf16, HalfFormat::F16] {
            assert_eq!(HalfFormat::deserialize(text(format.name())), Ok(format));
        }
    }

    #[test]
    fn buffer_rule_names() {
        assert_eq!(
            buffers::deserialize(text("broadcast")),
            Ok(Some(BufferSync::Broadcast { root: 0 }))
        );
        assert_eq!(
            buffers::deserialize(text("average")),
            Ok(Some(BufferSync::Average))
        );
        assert_eq!(buffers::deserialize(text("off")), Ok(None));
        let err = buffers::deserialize(text("mean")).unwrap_err().to_string();
        assert_eq!(
            err,
            "unknown variant `mean`, expected one of `broadcast`, `average`, `off`"
        );
    }
}
