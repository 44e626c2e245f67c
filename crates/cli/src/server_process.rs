//! Looking at a local server process from outside (Linux): which process listens on a port,
//! how many major page faults it has taken, and reclaiming its memory the way the kernel does
//! for an idle process under memory pressure.

use std::fs;
use std::io;

/// The pid of the process listening on TCP `port` on this machine, if this user can see it.
pub fn pid_listening_on(port: u16) -> Option<u32> {
    let inodes = listening_socket_inodes(port);
    if inodes.is_empty() {
        return None;
    }
    for entry in fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(fds) = fs::read_dir(entry.path().join("fd")) else {
            continue;
        };
        for fd in fds.flatten() {
            if let Ok(target) = fs::read_link(fd.path()) {
                let target = target.to_string_lossy();
                if let Some(inode) = target
                    .strip_prefix("socket:[")
                    .and_then(|s| s.strip_suffix(']'))
                    .and_then(|s| s.parse::<u64>().ok())
                    && inodes.contains(&inode)
                {
                    return Some(pid);
                }
            }
        }
    }
    None
}

/// Inodes of listening sockets on `port`, from /proc/net/tcp and tcp6.
fn listening_socket_inodes(port: u16) -> Vec<u64> {
    const LISTEN: &str = "0A";
    let mut inodes = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            // sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            if fields.len() < 10 || fields[3] != LISTEN {
                continue;
            }
            let local_port = fields[1]
                .rsplit_once(':')
                .and_then(|(_, p)| u16::from_str_radix(p, 16).ok());
            if local_port == Some(port)
                && let Ok(inode) = fields[9].parse::<u64>()
            {
                inodes.push(inode);
            }
        }
    }
    inodes
}

/// Page faults a process has taken so far, from /proc/PID/stat.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Faults {
    /// Served from memory (a page mapped again, zeroed, or still in the page cache).
    pub minor: u64,
    /// Read back from disk or swap.
    pub major: u64,
}

impl Faults {
    /// The faults taken between `earlier` and `self`.
    pub fn since(self, earlier: Faults) -> Faults {
        Faults {
            minor: self.minor.saturating_sub(earlier.minor),
            major: self.major.saturating_sub(earlier.major),
        }
    }
}

pub fn faults(pid: u32) -> io::Result<Faults> {
    // minflt(10), majflt(12).
    let [minor, major] = stat_fields(pid, [10, 12])?;
    Ok(Faults { minor, major })
}

/// Numeric fields of /proc/PID/stat by their 1-based numbers in proc(5) (3 or more).
fn stat_fields<const N: usize>(pid: u32, numbers: [usize; N]) -> io::Result<[u64; N]> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // The command name (field 2) may hold spaces and parentheses: count from its last ')'.
    let after_name = stat
        .rfind(')')
        .map(|i| &stat[i + 1..])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "unexpected stat format"))?;
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    let mut out = [0; N];
    for (value, n) in out.iter_mut().zip(numbers) {
        *value = fields
            .get(n - 3)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "short /proc/PID/stat"))?;
    }
    Ok(out)
}

/// Clock ticks per second of the times in /proc (`USER_HZ`).
fn clock_ticks() -> f64 {
    // SAFETY: sysconf only reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if hz > 0 { hz as f64 } else { 100.0 }
}

/// CPU seconds a process has used so far (user and system, all threads), from /proc/PID/stat.
pub fn cpu_seconds(pid: u32) -> io::Result<f64> {
    // utime(14), stime(15).
    let [user, system] = stat_fields(pid, [14, 15])?;
    Ok((user + system) as f64 / clock_ticks())
}

/// CPU seconds the whole machine has been busy so far, from the first line of /proc/stat:
/// user, nice, system, irq, softirq and steal (time the hypervisor gave this machine's CPUs
/// to someone else), summed over CPUs.
pub fn machine_busy_seconds() -> io::Result<f64> {
    let stat = fs::read_to_string("/proc/stat")?;
    let line = stat
        .lines()
        .next()
        .filter(|l| l.starts_with("cpu "))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "no cpu line in /proc/stat"))?;
    Ok(parse_busy_ticks(line)? as f64 / clock_ticks())
}

/// Busy ticks of a /proc/stat `cpu` line: user nice system idle iowait irq softirq steal ...
fn parse_busy_ticks(line: &str) -> io::Result<u64> {
    let fields: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    if fields.len() < 8 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "short cpu line in /proc/stat",
        ));
    }
    Ok([0, 1, 2, 5, 6, 7].iter().map(|&i| fields[i]).sum())
}

/// What one reclaim did.
#[derive(Clone, Copy, Debug, Default)]
pub struct PageOut {
    /// Mappings advised.
    pub mappings: usize,
    /// Bytes of those mappings.
    pub bytes: u64,
    /// Mappings the kernel would not page out: locked ones (what a residency set holds) and
    /// special ones such as [vvar].
    pub refused: usize,
}

/// Asks the kernel to page out every mapping of `pid` (`process_madvise(MADV_PAGEOUT)`, Linux ≥
/// 5.10, needing the right to ptrace the process and CAP_SYS_NICE): file pages are dropped,
/// anonymous pages go to swap where there is swap, locked pages are skipped. This is what the
/// kernel's reclaim does to an idle process, applied to one process only: no machine-wide
/// memory pressure.
#[cfg(target_os = "linux")]
pub fn page_out(pid: u32) -> io::Result<PageOut> {
    const MADV_PAGEOUT: libc::c_int = 21;
    let maps = fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let ranges: Vec<(usize, usize)> = maps
        .lines()
        .filter(|l| !l.ends_with("[vsyscall]"))
        .filter_map(|l| {
            let (start, end) = l.split_whitespace().next()?.split_once('-')?;
            let start = usize::from_str_radix(start, 16).ok()?;
            let end = usize::from_str_radix(end, 16).ok()?;
            (end > start).then_some((start, end - start))
        })
        .collect();

    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if pidfd < 0 {
        return Err(io::Error::last_os_error());
    }
    let pidfd = pidfd as libc::c_int;
    let advise = |ranges: &[(usize, usize)]| -> io::Result<usize> {
        let iov: Vec<libc::iovec> = ranges
            .iter()
            .map(|&(base, len)| libc::iovec {
                iov_base: base as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        // SAFETY: the iovecs name ranges in the other process; the kernel only reads them.
        let n = unsafe {
            libc::syscall(
                libc::SYS_process_madvise,
                pidfd,
                iov.as_ptr(),
                iov.len(),
                MADV_PAGEOUT,
                0u32,
            )
        };
        if n < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    };

    let mut report = PageOut::default();
    let mut first_error = None;
    // One mapping per call: a batch stops at its first refused mapping, and the kernel caps a
    // call's total length, so batching would need the same bookkeeping for little gain.
    for &range in &ranges {
        match advise(&[range]) {
            Ok(_) => {
                report.mappings += 1;
                report.bytes += range.1 as u64;
            }
            Err(e) => {
                report.refused += 1;
                first_error.get_or_insert(e);
            }
        }
    }
    // SAFETY: pidfd is ours and closed once.
    unsafe { libc::close(pidfd) };
    match first_error {
        Some(e) if report.mappings == 0 => Err(e),
        _ => Ok(report),
    }
}

#[cfg(not(target_os = "linux"))]
pub fn page_out(_pid: u32) -> io::Result<PageOut> {
    Err(io::Error::new(
        io::ErrorKind::Unsupported,
        "--evict needs Linux (process_madvise)",
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_own_faults() {
        let before = faults(std::process::id()).unwrap();
        // Touch fresh pages: minor faults, counted.
        let pages = vec![1u8; 64 << 20];
        std::hint::black_box(&pages);
        let after = faults(std::process::id()).unwrap();
        assert!(after.since(before).minor > 0);
    }

    #[test]
    fn busy_ticks_leave_out_idle_and_iowait() {
        let line = "cpu  100 20 30 4000 50 6 7 8 0 0";
        assert_eq!(parse_busy_ticks(line).unwrap(), 100 + 20 + 30 + 6 + 7 + 8);
        assert!(parse_busy_ticks("cpu 1 2 3").is_err());
    }

    #[test]
    fn counts_cpu_time() {
        let machine = machine_busy_seconds().unwrap();
        let own = cpu_seconds(std::process::id()).unwrap();
        // Burn a little CPU; /proc counts in ticks, so only look for no decrease.
        let mut x = 0u64;
        for i in 0..10_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        assert!(machine_busy_seconds().unwrap() >= machine);
        assert!(cpu_seconds(std::process::id()).unwrap() >= own);
    }

    #[test]
    fn finds_the_process_listening_on_a_port() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        assert_eq!(pid_listening_on(port), Some(std::process::id()));
    }
}
