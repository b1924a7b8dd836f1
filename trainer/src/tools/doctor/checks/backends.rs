//! This build's backends against the config's `output.device`, and the devices behind them: the
//! CUDA driver, the GPUs and NCCL, the wgpu adapter (probed in [`crate::engine::device::device_facts`]).

use crate::config::DeviceKind;
use crate::engine::device::{
    device_name, rebuild_advice, CudaFacts, CudaProblem, DeviceFacts, DeviceJob, WgpuAdapter,
    WgpuProblem,
};
use crate::finding::{Finding, Status};

/// The devices: this build's backends against the config's `output.device`, and in builds that
/// have them the CUDA driver, GPUs and NCCL, and the wgpu adapter. A problem fails the check for
/// the device the job uses, and is a warning for another.
pub fn devices(job: &DeviceJob, facts: &DeviceFacts) -> Vec<Finding> {
    let mut findings = vec![build(job, &facts.built)];
    if let Some(cuda) = &facts.cuda {
        findings.extend(cuda_devices(job, cuda, facts.nccl.as_ref()));
    }
    if let Some(wgpu) = &facts.wgpu {
        findings.push(wgpu_adapter(job, wgpu));
    }
    findings
}

/// Whether this build has the device the config asks for.
fn build(job: &DeviceJob, built: &[DeviceKind]) -> Finding {
    let here: Vec<String> = built
        .iter()
        .map(|&d| format!("\"{}\"", device_name(d)))
        .collect();
    let text = format!("this build trains on {}", here.join(", "));
    match job.device {
        Some(d) if !built.contains(&d) => {
            let name = device_name(d);
            Finding::fail(
                "build",
                format!("output.device = \"{name}\", but {text}"),
                // The doctor is a command of the `trainer` binary only.
                format!(
                    "{}, or set output.device = \"cpu\"",
                    rebuild_advice(d, "trainer")
                ),
            )
        }
        Some(d) => Finding::ok(
            "build",
            format!("{text}; the config uses \"{}\"", device_name(d)),
        ),
        None => Finding::ok("build", text),
    }
}

/// How a device problem counts: a failure for the device the job uses, else a warning.
fn severity(wanted: bool) -> Status {
    if wanted {
        Status::Fail
    } else {
        Status::Warn
    }
}

/// The CUDA driver, the GPUs the local ranks would use, and NCCL.
fn cuda_devices(
    job: &DeviceJob,
    cuda: &Result<CudaFacts, CudaProblem>,
    nccl: Option<&Result<String, String>>,
) -> Vec<Finding> {
    const CPU: &str = "or train on the CPU: output.device = \"cpu\"";
    let wanted = job.wants_cuda();
    let status = severity(wanted);
    let mut findings = Vec::new();
    match cuda {
        Ok(f) => {
            findings.push(Finding::ok(
                "cuda driver",
                format!(
                    "driver for CUDA {}.{} at {}",
                    f.driver_version.0, f.driver_version.1, f.library
                ),
            ));
            let detail = format!(
                "{} visible (CUDA_VISIBLE_DEVICES={}), device 0 is {}; {} local rank(s) use device(s) 0..{}",
                f.device_count, f.visible, f.first_device, job.local_ranks, f.needed
            );
            findings.push(if f.device_count >= f.needed {
                Finding::ok("gpus", detail)
            } else {
                Finding::new(
                    "gpus",
                    status,
                    format!("{detail}, but only {} exist", f.device_count),
                    Some(format!(
                        "run at most {0} ranks per machine (--nproc-per-node {0}), or expose more GPUs",
                        f.device_count
                    )),
                )
            });
        }
        Err(CudaProblem::DriverNotFound { tried, reason }) => findings.push(Finding::new(
            "cuda driver",
            status,
            format!("no CUDA driver was found (tried {tried}: {reason})"),
            Some(format!("install the NVIDIA driver and check that `nvidia-smi` works; in a container, start it with the GPUs exposed (`docker run --gpus all`); if the driver is in a non-standard folder, add it to LD_LIBRARY_PATH; {CPU}")),
        )),
        Err(CudaProblem::Other(message)) => findings.push(Finding::new(
            "cuda driver",
            status,
            message.clone(),
            Some(format!("do what the message says, {CPU}")),
        )),
    }
    let Some(nccl) = nccl.filter(|_| wanted) else {
        findings.push(Finding::skip(
            "nccl",
            "not used: the config trains on another device",
        ));
        return findings;
    };
    let nccl_needed = job.nccl_on_cuda();
    findings.push(match nccl {
        Ok(version) => Finding::ok("nccl", format!("NCCL {version}")),
        Err(e) if nccl_needed => Finding::fail(
            "nccl",
            e.clone(),
            "install NCCL as the message says, or set distributed.gradient_sync = \"host\" (gradients averaged through the host)",
        ),
        Err(e) => Finding::warn(
            "nccl",
            format!("{e} (this job averages gradients through the host, so it runs without)"),
            "install NCCL as the message says to average gradients on the GPU of a multi-rank CUDA job",
        ),
    });
    findings
}

/// The adapter Burn's wgpu backend would pick.
fn wgpu_adapter(job: &DeviceJob, adapter: &Result<WgpuAdapter, WgpuProblem>) -> Finding {
    const CHECK: &str = "wgpu adapter";
    let wanted = job.device == Some(DeviceKind::Wgpu);
    match adapter {
        Ok(a) if a.software && wanted => Finding::warn(
            CHECK,
            format!("{}: a software adapter, which runs on the CPU", a.description),
            "it works; for speed install the GPU's Vulkan driver, or compare with output.device = \"cpu\"",
        ),
        Ok(a) => Finding::ok(CHECK, a.description.clone()),
        Err(WgpuProblem::NotFound(why)) => Finding::new(
            CHECK,
            severity(wanted),
            format!("no adapter found: {why}"),
            Some("install a Vulkan driver (Mesa's lavapipe runs on any CPU: `apt-get install mesa-vulkan-drivers`), or set output.device = \"cpu\"".into()),
        ),
        Err(WgpuProblem::Timeout(secs)) => Finding::new(
            CHECK,
            severity(wanted),
            format!("no adapter within {secs} s"),
            Some("check the GPU driver (`vulkaninfo --summary`), or set output.device = \"cpu\"".into()),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device_job(device: Option<DeviceKind>, local_ranks: usize) -> DeviceJob {
        DeviceJob {
            device,
            local_ranks,
            world_size: local_ranks,
            gradient_sync: Default::default(),
        }
    }

    fn cpu_build() -> DeviceFacts {
        DeviceFacts {
            built: vec![DeviceKind::Cpu],
            cuda: None,
            nccl: None,
            wgpu: None,
        }
    }

    fn gpus(count: usize, needed: usize) -> CudaFacts {
        CudaFacts {
            driver_version: (12, 4),
            library: "libcuda.so.1".into(),
            device_count: count,
            first_device: "NVIDIA H100".into(),
            visible: "<unset>".into(),
            needed,
        }
    }

    fn statuses(findings: &[Finding]) -> Vec<(&'static str, Status)> {
        findings.iter().map(|f| (f.check, f.status)).collect()
    }

    #[test]
    fn a_device_the_build_lacks_fails_naming_the_feature() {
        let found = devices(&device_job(Some(DeviceKind::Cuda), 2), &cpu_build());
        assert_eq!(statuses(&found), vec![("build", Status::Fail)]);
        assert!(found[0].detail.contains("this build trains on \"cpu\""));
        assert!(found[0]
            .advice
            .as_deref()
            .unwrap_or("")
            .contains("--features cuda"));
        let ok = devices(&device_job(Some(DeviceKind::Cpu), 2), &cpu_build());
        assert_eq!(statuses(&ok), vec![("build", Status::Ok)]);
    }

    #[test]
    fn cuda_problems_fail_the_cuda_job_and_warn_another() {
        let facts = DeviceFacts {
            built: vec![DeviceKind::Cpu, DeviceKind::Cuda],
            cuda: Some(Err(CudaProblem::DriverNotFound {
                tried: "libcuda.so.1".into(),
                reason: "not found".into(),
            })),
            nccl: Some(Err("no NCCL".into())),
            wgpu: None,
        };
        let wanted = devices(&device_job(Some(DeviceKind::Cuda), 2), &facts);
        assert_eq!(
            statuses(&wanted),
            vec![
                ("build", Status::Ok),
                ("cuda driver", Status::Fail),
                ("nccl", Status::Fail)
            ]
        );
        let other = devices(&device_job(Some(DeviceKind::Cpu), 2), &facts);
        assert_eq!(
            statuses(&other),
            vec![
                ("build", Status::Ok),
                ("cuda driver", Status::Warn),
                ("nccl", Status::Skip)
            ]
        );
    }

    #[test]
    fn too_few_gpus_for_the_local_ranks_and_nccl_only_needed_for_several_ranks() {
        let facts = |count, needed, nccl: Result<String, String>| DeviceFacts {
            built: vec![DeviceKind::Cpu, DeviceKind::Cuda],
            cuda: Some(Ok(gpus(count, needed))),
            nccl: Some(nccl),
            wgpu: None,
        };
        let short = devices(
            &device_job(Some(DeviceKind::Cuda), 4),
            &facts(2, 4, Ok("2.21.5 at libnccl.so.2".into())),
        );
        assert_eq!(short[2].check, "gpus");
        assert_eq!(short[2].status, Status::Fail);
        assert!(
            short[2].detail.ends_with("but only 2 exist"),
            "{}",
            short[2].detail
        );
        assert_eq!(short[3].detail, "NCCL 2.21.5 at libnccl.so.2");
        // One rank averages nothing: a missing NCCL only warns.
        let alone = devices(
            &device_job(Some(DeviceKind::Cuda), 1),
            &facts(1, 1, Err("no NCCL".into())),
        );
        assert_eq!(
            statuses(&alone)[1..],
            [
                ("cuda driver", Status::Ok),
                ("gpus", Status::Ok),
                ("nccl", Status::Warn)
            ]
        );
    }

    #[test]
    fn a_software_wgpu_adapter_warns_only_a_wgpu_job() {
        let facts = DeviceFacts {
            built: vec![DeviceKind::Cpu, DeviceKind::Wgpu],
            cuda: None,
            nccl: None,
            wgpu: Some(Ok(WgpuAdapter {
                description: "llvmpipe (Vulkan, Cpu, driver Mesa)".into(),
                software: true,
            })),
        };
        let wgpu_job = devices(&device_job(Some(DeviceKind::Wgpu), 1), &facts);
        assert_eq!(wgpu_job[1].status, Status::Warn);
        let cpu_job = devices(&device_job(Some(DeviceKind::Cpu), 1), &facts);
        assert_eq!(cpu_job[1].status, Status::Ok);
        let timeout = DeviceFacts {
            wgpu: Some(Err(WgpuProblem::Timeout(60))),
            ..facts
        };
        let found = devices(&device_job(Some(DeviceKind::Wgpu), 1), &timeout);
        assert_eq!(found[1].status, Status::Fail);
        assert_eq!(found[1].detail, "no adapter within 60 s");
    }
}
