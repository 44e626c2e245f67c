//! What a set's load says: whether it is held, its figures, and why not ([`NoSet`]), as the
//! one load line.

use std::fmt;

use crate::backend::BackendError;
use crate::bound::{Bound, fmt_gib};

/// Why no set is held.
#[derive(Clone, Debug, PartialEq)]
pub enum NoSet {
    /// Turned off by the operator.
    Disabled,
    /// The host regions plus the margin pass the gross bound (figures in the report).
    OverBound,
    /// A GPU's device regions (`bytes` of them) pass the device bound, `limit` a GPU.
    OverDeviceBound { gpu: usize, bytes: u64, limit: u64 },
    /// The backend refused `prepare` or a `hold`; everything held before it was released.
    Refused {
        backend: &'static str,
        error: BackendError,
    },
    /// The caller listed one id twice (a bug in the caller; holding twice would unlock early).
    DuplicateId(u64),
    /// The set's own bookkeeping could not be allocated.
    NoMemory,
}

/// What happened at load, with the numbers for the one load line.
#[derive(Clone, Debug, PartialEq)]
pub struct LoadReport {
    /// True when the whole set is held.
    pub held: bool,
    /// Regions offered at load.
    pub buffers: usize,
    /// Their bytes, host and device together.
    pub bytes: u64,
    pub host_bytes: u64,
    pub device_bytes: u64,
    /// `device_bytes` by GPU, for the GPUs that have any: `(ordinal, bytes)`.
    pub gpu_bytes: Vec<(usize, u64)>,
    /// The bound the set was checked against (`None` when disabled).
    pub bound: Option<Bound>,
    /// Why nothing is held; `None` when held.
    pub reason: Option<NoSet>,
}

impl LoadReport {
    /// The load line, e.g.
    /// `residency: 412 buffers (1.23 GiB) held between requests, inside 70% of 23.4 GiB RAM less 2 GiB (14.4 GiB)`
    /// (with device memory in the set, `(17.1 GiB: 0.58 GiB host, 16.5 GiB device)` and the
    /// device bound after the host's; over several GPUs, `8.25 GiB on GPU 0, 8.25 GiB on GPU
    /// 1` and each GPU's bound) or
    /// `residency: none: engine 1.23 GiB + 2 GiB margin pass the 1.00 GiB load limit; raise --load-limit-gib or lower --context`.
    pub fn line(&self) -> String {
        let bound = self.bound.as_ref();
        let mut bound_text = bound.map(Bound::describe).unwrap_or_default();
        let mut size = fmt_gib(self.bytes);
        if self.device_bytes > 0 {
            let (device, each) = match self.gpu_bytes.as_slice() {
                [_, _, ..] => {
                    let per_gpu = self
                        .gpu_bytes
                        .iter()
                        .map(|&(gpu, bytes)| format!("{} on GPU {gpu}", fmt_gib(bytes)));
                    (per_gpu.collect::<Vec<_>>().join(", "), " a GPU")
                }
                _ => (format!("{} device", fmt_gib(self.device_bytes)), ""),
            };
            size = format!("{size}: {} host, {device}", fmt_gib(self.host_bytes));
            if let Some(limit) = bound.and_then(Bound::device_bytes) {
                bound_text = format!("{bound_text} and {} of device memory{each}", fmt_gib(limit));
            }
        }
        let advice = bound.map(Bound::advice).unwrap_or_default();
        match &self.reason {
            None => format!(
                "residency: {} {} ({size}) held between requests, inside {bound_text}",
                self.buffers,
                if self.buffers == 1 {
                    "buffer"
                } else {
                    "buffers"
                },
            ),
            Some(NoSet::Disabled) => "residency: off (--no-residency)".into(),
            Some(NoSet::OverBound) => {
                let Some(b) = bound else {
                    return "residency: none: over the bound".into();
                };
                if b.margin_bytes() > 0 {
                    format!(
                        "residency: none: engine {} + {} margin pass {}; {advice}",
                        fmt_gib(self.host_bytes),
                        b.describe_margin(),
                        b.describe_gross()
                    )
                } else {
                    format!(
                        "residency: none: engine {} passes {}; {advice}",
                        fmt_gib(self.host_bytes),
                        b.describe_gross()
                    )
                }
            }
            Some(NoSet::OverDeviceBound { gpu, bytes, limit }) => format!(
                "residency: none: engine device buffers {}{} pass the {} device bound; {}",
                fmt_gib(*bytes),
                match self.gpu_bytes.len() {
                    0 | 1 => String::new(),
                    _ => format!(" on GPU {gpu}"),
                },
                fmt_gib(*limit),
                bound.map_or_else(|| "lower --context".into(), Bound::device_advice)
            ),
            Some(NoSet::Refused { backend, error }) => {
                format!(
                    "residency: none: {backend} refused ({error}); {}",
                    error.advice
                )
            }
            Some(NoSet::DuplicateId(id)) => format!(
                "residency: none: buffer {id} listed twice ({} buffers, {}); this is a bug",
                self.buffers,
                fmt_gib(self.bytes)
            ),
            Some(NoSet::NoMemory) => format!(
                "residency: none: no memory for the set's own list of {} buffers",
                self.buffers
            ),
        }
    }

    /// Logs the load line once: info when held or off, a warning when no set is held.
    pub fn log(&self) {
        match self.reason {
            None | Some(NoSet::Disabled) => tracing::info!("{}", self.line()),
            Some(_) => tracing::warn!("{}", self.line()),
        }
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.line())
    }
}
