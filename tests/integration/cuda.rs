//! `output.device = "cuda"` in a `--features cuda` build. Without a GPU (CI): a clear message and
//! exit code 2 from a single process and from the launcher — no panic, no hang. On a machine
//! with a GPU and NCCL: one rank trains the digits through the NCCL path (gradients packed,
//! all-reduced and unpacked on the GPU), f32 and bf16, to the accuracy of the CPU run.

use crate::common::*;
use burn_ddp::testing::Needs;

fn on_cuda(config: String, compression: &str) -> String {
    let with_device = config.replace("[output]\n", "[output]\ndevice = \"cuda\"\n");
    assert_ne!(with_device, config, "digits_config has an [output] table");
    with_device
        + &format!(
            "\n[distributed]\ngradient_sync = \"nccl\"\ngradient_compression = \"{compression}\"\n"
        )
}

#[test]
fn cuda_trains_on_a_gpu_or_says_clearly_why_not() {
    let dir = scratch("cuda");
    let gpu = burn_ddp::cuda::check_cuda_available(0).is_ok()
        && burn_ddp::cuda::check_nccl_available().is_ok();
    if !gpu {
        let config = write_config(&dir, "none", &on_cuda(digits_config(ADAM, 16, ""), "none"));
        for nproc in [None, Some("2")] {
            let mut cmd = trainer();
            cmd.arg("--config").arg(&config);
            if let Some(n) = nproc {
                cmd.args(["--nproc-per-node", n]);
            }
            let out = run(&mut cmd);
            let all = out.all();
            assert_eq!(out.code, Some(2), "{nproc:?}: {all}");
            assert!(
                all.contains("output.device = \"cuda\"") && all.contains("CUDA"),
                "{nproc:?}: the message names the setting and what is missing: {all}"
            );
            assert!(!all.contains("panicked"), "{nproc:?}: {all}");
        }
        burn_ddp::testing::skip(
            Needs::Gpu,
            "no CUDA device with NCCL: checked the clear error only, not training on a GPU",
        );
        return;
    }
    let cpu = write_config(&dir, "cpu", &digits_config(ADAM, 16, ""));
    let cpu_accuracy = final_accuracy(&train(&cpu, 1));
    for compression in ["none", "bf16"] {
        let config = on_cuda(digits_config(ADAM, 16, ""), compression);
        let out = train(&write_config(&dir, compression, &config), 1);
        assert!(
            out.all().contains("gradients are averaged with NCCL"),
            "{}",
            out.all()
        );
        let accuracy = final_accuracy(&out);
        eprintln!("cuda + NCCL, {compression}: {accuracy}% (CPU: {cpu_accuracy}%)");
        assert!(
            (accuracy - cpu_accuracy).abs() <= 3.0,
            "{compression}: {accuracy}% on the GPU against {cpu_accuracy}% on the CPU"
        );
    }
}

/// Whether this machine has a CUDA driver library, found the way the driver is loaded
/// (`dlopen`), independently of the code under test.
fn cuda_driver_loads() -> bool {
    ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
        let name = std::ffi::CString::new(*name).expect("no NUL");
        // SAFETY: a valid NUL-terminated name; the handle is left open (unloading a driver
        // library is a known source of crashes).
        let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        !handle.is_null()
    })
}

#[test]
fn doctor_says_when_there_is_no_cuda_driver() {
    let out = run(trainer().args(["doctor", "--skip-allreduce"]));
    assert!(!out.all().contains("panicked"), "{}", out.all());
    let driver = crate::doctor::check_line(&out, "cuda driver");
    if cuda_driver_loads() {
        assert!(
            !driver.line.contains("no CUDA driver was found"),
            "a driver is installed here:\n{}",
            out.all()
        );
        if burn_ddp::cuda::check_cuda_available(0).is_ok() {
            assert_eq!(driver.status, "ok", "{}", out.all());
            assert_eq!(crate::doctor::check_line(&out, "gpus").status, "ok");
        }
        return;
    }
    assert_eq!(out.code, Some(1), "{}", out.all());
    assert_eq!(driver.status, "FAIL", "{}", out.all());
    assert!(
        driver.line.contains("no CUDA driver was found"),
        "{}",
        driver.line
    );
    let advice = driver.advice.unwrap_or_default();
    assert!(
        advice.contains("nvidia-smi") && advice.contains("output.device = \"cpu\""),
        "{}",
        out.all()
    );
    burn_ddp::testing::skip(
        Needs::Gpu,
        "no CUDA driver: checked the doctor's report of a missing driver only",
    );
}
