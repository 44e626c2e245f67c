//! The bound: how much memory the whole set may hold, and how that figure is said at load.

use std::fmt;

/// One GiB.
pub const GIB: u64 = 1 << 30;

/// Share of memory the set may hold by default, in percent.
pub const DEFAULT_PERCENT: u64 = 70;

/// What the set always leaves for everything else (the OS, the rest of the process).
pub const MARGIN_BYTES: u64 = 2 * GIB;

/// GiB as the load line writes them: two decimals under 10 GiB, one above
/// (`1.23 GiB`, `23.4 GiB`), so small and large figures both keep three digits.
pub fn fmt_gib(bytes: u64) -> String {
    let g = bytes as f64 / GIB as f64;
    if g < 10.0 {
        format!("{g:.2} GiB")
    } else {
        format!("{g:.1} GiB")
    }
}

/// Bytes in the unit that reads best (hints about small limits: `8.00 MiB`).
pub fn fmt_bytes(bytes: u64) -> String {
    const MIB: u64 = 1 << 20;
    if bytes >= GIB {
        fmt_gib(bytes)
    } else if bytes >= MIB {
        format!("{:.2} MiB", bytes as f64 / MIB as f64)
    } else if bytes >= 1024 {
        format!("{:.1} KiB", bytes as f64 / 1024.0)
    } else {
        format!("{bytes} B")
    }
}

/// The margin as written: a whole number of GiB when it is one (`2 GiB`).
fn fmt_margin(bytes: u64) -> String {
    if bytes.is_multiple_of(GIB) {
        format!("{} GiB", bytes / GIB)
    } else {
        fmt_gib(bytes)
    }
}

/// Where the gross figure came from; decides its wording and the advice on refusal.
#[derive(Clone, Debug, PartialEq)]
enum Source {
    /// `percent` of `memory`, which is physical RAM or a lower cgroup limit (`what`).
    Share {
        percent: u64,
        memory: u64,
        what: &'static str,
    },
    /// The operator's `--load-limit-gib`.
    LoadLimit { bytes: u64 },
    /// The load limit, cut to the memory the process may really have.
    LoadLimitCapped {
        limit: u64,
        memory: u64,
        what: &'static str,
    },
    /// Neither RAM nor a cgroup limit could be read.
    Unknown,
    /// Given by a caller (tests), with its own words.
    Fixed(String),
}

/// How much the set may hold: a gross figure less a margin, plus an optional device bound.
///
/// The default is 70% of physical RAM less 2 GiB. A load limit replaces the 70% (the operator
/// chose to let the server take more); the margin stays. A cgroup memory limit below RAM stands
/// in for RAM, since locked pages count against it and the kernel kills past it.
#[derive(Clone, Debug, PartialEq)]
pub struct Bound {
    gross: u64,
    margin: u64,
    source: Source,
    device: Option<u64>,
    advice: Option<String>,
    device_advice: Option<String>,
}

impl Bound {
    /// The bound for this machine: 70% of physical RAM (or `load_limit_gib` in its place) less
    /// a 2 GiB margin, with RAM lowered to a cgroup memory limit where one is lower.
    pub fn from_system(load_limit_gib: Option<f64>) -> Bound {
        Bound::from_figures(physical_ram(), cgroup_memory_limit(), load_limit_gib)
    }

    /// [`from_system`](Self::from_system) on given figures, so the arithmetic and wording can
    /// be checked without the machine: physical RAM, a cgroup limit, the load limit.
    pub fn from_figures(
        ram: Option<u64>,
        cgroup_limit: Option<u64>,
        load_limit_gib: Option<f64>,
    ) -> Bound {
        let memory = match (ram, cgroup_limit) {
            (Some(r), Some(c)) if c < r => Some((c, "cgroup memory limit")),
            (Some(r), _) => Some((r, "RAM")),
            (None, Some(c)) => Some((c, "cgroup memory limit")),
            (None, None) => None,
        };
        let (gross, source) = match (load_limit_gib, memory) {
            (Some(gib), memory) => {
                // NaN and negatives mean nothing may be held; the CLI rejects them first.
                let limit = if gib.is_finite() && gib > 0.0 {
                    (gib * GIB as f64).min(u64::MAX as f64) as u64
                } else {
                    0
                };
                match memory {
                    Some((m, what)) if m < limit => (
                        m,
                        Source::LoadLimitCapped {
                            limit,
                            memory: m,
                            what,
                        },
                    ),
                    _ => (limit, Source::LoadLimit { bytes: limit }),
                }
            }
            (None, Some((m, what))) => (
                (m as u128 * DEFAULT_PERCENT as u128 / 100) as u64,
                Source::Share {
                    percent: DEFAULT_PERCENT,
                    memory: m,
                    what,
                },
            ),
            (None, None) => (0, Source::Unknown),
        };
        Bound {
            gross,
            margin: MARGIN_BYTES,
            source,
            device: None,
            advice: None,
            device_advice: None,
        }
    }

    /// A bound of exactly `bytes` (no margin), described as `describe` (tests, embedders).
    pub fn fixed(bytes: u64, describe: impl Into<String>) -> Bound {
        Bound {
            gross: bytes,
            margin: 0,
            source: Source::Fixed(describe.into()),
            device: None,
            advice: None,
            device_advice: None,
        }
    }

    /// Also bounds device regions, each GPU's by `bytes` (e.g. the GPU's memory less what
    /// the engine leaves free; the smallest GPU's where they differ). Without it device
    /// regions are counted but unbounded.
    pub fn with_device_limit(mut self, bytes: u64) -> Bound {
        self.device = Some(bytes);
        self
    }

    /// Replaces the advice that ends a refusal line (the caller knows its own flags, e.g.
    /// `lower --prompt-cache-gib, --parallel or --context, or set --load-limit-gib`).
    pub fn with_advice(mut self, advice: impl Into<String>) -> Bound {
        self.advice = Some(advice.into());
        self
    }

    /// Replaces the advice that ends a refusal over the device bound (`lower --context`).
    pub fn with_device_advice(mut self, advice: impl Into<String>) -> Bound {
        self.device_advice = Some(advice.into());
        self
    }

    /// What an operator can change when the device buffers do not fit.
    pub fn device_advice(&self) -> String {
        self.device_advice
            .clone()
            .unwrap_or_else(|| "lower --context".into())
    }

    /// Host bytes the set may hold: the gross figure less the margin.
    pub fn host_bytes(&self) -> u64 {
        self.gross.saturating_sub(self.margin)
    }

    /// Device bytes the set may hold, if bounded.
    pub fn device_bytes(&self) -> Option<u64> {
        self.device
    }

    /// The gross figure (70% of RAM, or the load limit) before the margin.
    pub fn gross_bytes(&self) -> u64 {
        self.gross
    }

    pub fn margin_bytes(&self) -> u64 {
        self.margin
    }

    /// The gross figure in words: `70% of 23.4 GiB RAM`, `the 1.00 GiB load limit`.
    pub fn describe_gross(&self) -> String {
        match &self.source {
            Source::Share {
                percent,
                memory,
                what,
            } => format!("{percent}% of {} {what}", fmt_gib(*memory)),
            Source::LoadLimit { bytes } => format!("the {} load limit", fmt_gib(*bytes)),
            Source::LoadLimitCapped {
                limit,
                memory,
                what,
            } => format!(
                "the {} {what} (below the {} load limit)",
                fmt_gib(*memory),
                fmt_gib(*limit)
            ),
            Source::Unknown => "an unknown amount of RAM".into(),
            Source::Fixed(text) => text.clone(),
        }
    }

    /// The whole bound in words, for the held line:
    /// `70% of 23.4 GiB RAM less 2 GiB (14.4 GiB)`.
    pub fn describe(&self) -> String {
        if self.margin == 0 {
            return self.describe_gross();
        }
        format!(
            "{} less {} ({})",
            self.describe_gross(),
            fmt_margin(self.margin),
            fmt_gib(self.host_bytes())
        )
    }

    /// The margin in words (`2 GiB`).
    pub fn describe_margin(&self) -> String {
        fmt_margin(self.margin)
    }

    /// What an operator can change when the set does not fit.
    pub fn advice(&self) -> String {
        if let Some(a) = &self.advice {
            return a.clone();
        }
        match &self.source {
            Source::Share { what: "RAM", .. } => "lower --context or set --load-limit-gib".into(),
            Source::Share { .. } | Source::LoadLimitCapped { .. } => {
                "lower --context or raise the cgroup memory limit".into()
            }
            Source::LoadLimit { .. } => "raise --load-limit-gib or lower --context".into(),
            Source::Unknown => "set --load-limit-gib".into(),
            Source::Fixed(_) => "lower --context".into(),
        }
    }
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.describe())
    }
}

/// Physical RAM in bytes.
#[cfg(any(target_os = "linux", target_os = "android"))]
fn physical_ram() -> Option<u64> {
    // SAFETY: sysinfo only writes into the zeroed struct it is given.
    let mut info: libc::sysinfo = unsafe { std::mem::zeroed() };
    if unsafe { libc::sysinfo(&mut info) } != 0 {
        return None;
    }
    (info.totalram as u64).checked_mul(info.mem_unit.max(1) as u64)
}

/// Physical RAM in bytes.
#[cfg(target_os = "macos")]
fn physical_ram() -> Option<u64> {
    let mut bytes: u64 = 0;
    let mut len = std::mem::size_of::<u64>();
    // SAFETY: hw.memsize is a u64; `len` tells sysctl the room it has.
    let rc = unsafe {
        libc::sysctlbyname(
            c"hw.memsize".as_ptr(),
            (&mut bytes as *mut u64).cast(),
            &mut len,
            std::ptr::null_mut(),
            0,
        )
    };
    (rc == 0 && bytes > 0).then_some(bytes)
}

/// Physical RAM in bytes.
#[cfg(not(any(target_os = "linux", target_os = "android", target_os = "macos")))]
fn physical_ram() -> Option<u64> {
    None
}

/// The tightest memory limit of this process's cgroup and its ancestors (cgroup v2
/// `memory.max`, or v1 `memory.limit_in_bytes`), if any is set.
fn cgroup_memory_limit() -> Option<u64> {
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let mut tightest: Option<u64> = None;
    for line in cgroups.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let (root, file) = if controllers.is_empty() {
            ("/sys/fs/cgroup", "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            ("/sys/fs/cgroup/memory", "memory.limit_in_bytes")
        } else {
            continue;
        };
        if let Some(limit) = limit_along(root, path, file) {
            tightest = Some(tightest.map_or(limit, |t| t.min(limit)));
        }
    }
    tightest
}

/// The lowest limit in `file` from `root/path` up to `root`.
fn limit_along(root: &str, path: &str, file: &str) -> Option<u64> {
    let mut dir = path.trim_end_matches('/').to_string();
    let mut tightest: Option<u64> = None;
    loop {
        let text = std::fs::read_to_string(format!("{root}{dir}/{file}")).ok();
        // "max" (v2) and page-rounded i64::MAX (v1) both mean no limit.
        if let Some(limit) = text
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|&l| l < 1 << 60)
        {
            tightest = Some(tightest.map_or(limit, |t| t.min(limit)));
        }
        match dir.rfind('/') {
            Some(cut) => dir.truncate(cut),
            None => break,
        }
    }
    tightest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_seventy_percent_of_ram_less_two_gib() {
        let ram = (23.4 * GIB as f64) as u64;
        let b = Bound::from_figures(Some(ram), None, None);
        assert_eq!(b.gross_bytes(), ram * 70 / 100);
        assert_eq!(b.host_bytes(), ram * 70 / 100 - 2 * GIB);
        assert_eq!(b.describe(), "70% of 23.4 GiB RAM less 2 GiB (14.4 GiB)");
        assert_eq!(b.describe_gross(), "70% of 23.4 GiB RAM");
        assert_eq!(b.advice(), "lower --context or set --load-limit-gib");
    }

    #[test]
    fn load_limit_replaces_the_share_and_keeps_the_margin() {
        let b = Bound::from_figures(Some(256 * GIB), None, Some(240.0));
        assert_eq!(b.gross_bytes(), 240 * GIB);
        assert_eq!(b.host_bytes(), 238 * GIB);
        assert_eq!(b.describe_gross(), "the 240.0 GiB load limit");
        let small = Bound::from_figures(Some(256 * GIB), None, Some(1.0));
        assert_eq!(small.host_bytes(), 0);
        assert_eq!(small.describe_gross(), "the 1.00 GiB load limit");
        assert_eq!(small.advice(), "raise --load-limit-gib or lower --context");
    }

    #[test]
    fn a_lower_cgroup_limit_stands_in_for_ram() {
        let b = Bound::from_figures(Some(64 * GIB), Some(8 * GIB), None);
        assert_eq!(b.gross_bytes(), 8 * GIB * 70 / 100);
        assert_eq!(b.describe_gross(), "70% of 8.00 GiB cgroup memory limit");
        let higher = Bound::from_figures(Some(64 * GIB), Some(128 * GIB), None);
        assert_eq!(higher.describe_gross(), "70% of 64.0 GiB RAM");
        let capped = Bound::from_figures(Some(64 * GIB), Some(8 * GIB), Some(12.0));
        assert_eq!(capped.gross_bytes(), 8 * GIB);
        assert_eq!(
            capped.describe_gross(),
            "the 8.00 GiB cgroup memory limit (below the 12.0 GiB load limit)"
        );
    }

    #[test]
    fn unknown_memory_holds_nothing_and_bad_limits_are_zero() {
        assert_eq!(Bound::from_figures(None, None, None).host_bytes(), 0);
        assert_eq!(
            Bound::from_figures(Some(GIB), None, Some(f64::NAN)).gross_bytes(),
            0
        );
        assert_eq!(
            Bound::from_figures(Some(GIB), None, Some(-3.0)).gross_bytes(),
            0
        );
    }

    #[test]
    fn the_system_bound_reads_this_machine() {
        let b = Bound::from_system(None);
        let ram = physical_ram().expect("sysinfo reads RAM here");
        assert!(b.gross_bytes() <= ram * 70 / 100);
        assert!(b.describe().starts_with("70% of "), "{}", b.describe());
    }

    #[test]
    fn gib_figures_keep_three_digits() {
        assert_eq!(fmt_gib((1.23 * GIB as f64) as u64), "1.23 GiB");
        assert_eq!(fmt_gib(GIB), "1.00 GiB");
        assert_eq!(fmt_gib(171 * GIB), "171.0 GiB");
        assert_eq!(fmt_margin(2 * GIB), "2 GiB");
        assert_eq!(fmt_bytes(8 << 20), "8.00 MiB");
    }
}
