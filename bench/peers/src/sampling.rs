//! What the benches against Dynamo (bench/peers, and bench/selection through `#[path]`) read off
//! the machine while they run, and how they summarise their samples.

/// The load average over 1, 5 and 15 minutes, as /proc/loadavg gives it.
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

pub const CLOCK_PROCESS_CPUTIME_ID: i32 = 2;
#[allow(dead_code)] // bench/selection's
pub const CLOCK_THREAD_CPUTIME_ID: i32 = 3;

/// CPU time used so far on `clock` (the process's or the calling thread's), in seconds.
pub fn cpu_seconds(clock: i32) -> f64 {
    #[repr(C)]
    struct Timespec {
        tv_sec: i64,
        tv_nsec: i64,
    }
    extern "C" {
        fn clock_gettime(clock: i32, out: *mut Timespec) -> i32;
    }
    let mut t = Timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: t is a valid timespec (64-bit Linux layout) for the call to write.
    unsafe { clock_gettime(clock, &mut t) };
    t.tv_sec as f64 + t.tv_nsec as f64 * 1e-9
}

/// Nearest-rank percentile (bench_common.h's `Percentile`).
pub fn percentile(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return 0.0;
    }
    let k = ((p * samples.len() as f64) as usize).min(samples.len() - 1);
    samples.select_nth_unstable_by(k, |a, b| a.total_cmp(b));
    samples[k]
}

pub fn median(samples: &mut [f64]) -> f64 {
    percentile(samples, 0.5)
}
