//! The program's own code, as regions to hold with everything else.
//!
//! Locking the model is not enough: measured on llama-server, a model `mlock`ed still took 24-29
//! major faults per request after a reclaim, all in the executable's and its libraries' pages.

use std::collections::HashSet;

use crate::backend::Region;

/// Where ids for [`executable_regions`] start (`CODE_ID_BASE + index`): far above the engine's
/// buffer ids, which count up from zero, so the two never collide in one set.
pub const CODE_ID_BASE: u64 = 1 << 63;

/// The read-only and executable file mappings of the running executable and its shared
/// libraries (`r-xp` and `r--p` mappings of every file that has an executable mapping), from
/// `/proc/self/maps`. Empty where /proc is absent (macOS).
///
/// Read-only mappings of files *without* code (a checkpoint mapped privately, locale data) are
/// left out: the engine lists its own files, and counting them here would count them twice.
/// Call it after the engine is loaded, so libraries opened at load (a GPU driver) are in.
pub fn executable_regions() -> Vec<Region> {
    match std::fs::read_to_string("/proc/self/maps") {
        Ok(text) => parse_maps(&text),
        Err(_) => Vec::new(),
    }
}

/// One `/proc/<pid>/maps` line: range, permissions, path.
fn parse_line(line: &str) -> Option<(usize, usize, &str, &str)> {
    let mut rest = line;
    let mut fields = [""; 5];
    for f in &mut fields {
        rest = rest.trim_start();
        let cut = rest.find(char::is_whitespace).unwrap_or(rest.len());
        *f = &rest[..cut];
        rest = &rest[cut..];
    }
    let [range, perms, _offset, _dev, _inode] = fields;
    let (start, end) = range.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    // The path is the rest of the line and may hold spaces.
    let path = rest.trim();
    (end > start && perms.len() == 4).then_some((start, end, perms, path))
}

pub(crate) fn parse_maps(text: &str) -> Vec<Region> {
    let lines: Vec<_> = text.lines().filter_map(parse_line).collect();
    let with_code: HashSet<&str> = lines
        .iter()
        .filter(|(_, _, perms, path)| path.starts_with('/') && perms.as_bytes()[2] == b'x')
        .map(|(_, _, _, path)| *path)
        .collect();
    lines
        .iter()
        .filter(|(_, _, perms, path)| with_code.contains(path) && matches!(*perms, "r-xp" | "r--p"))
        .map(|&(start, end, _, _)| Region::host(start, end - start))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_code_and_read_only_data_of_files_with_code() {
        let maps = "\
55d4c0000000-55d4c0010000 r--p 00000000 08:01 100 /usr/bin/ember
55d4c0010000-55d4c0050000 r-xp 00010000 08:01 100 /usr/bin/ember
55d4c0050000-55d4c0060000 r--p 00050000 08:01 100 /usr/bin/ember
55d4c0060000-55d4c0062000 rw-p 00060000 08:01 100 /usr/bin/ember
55d4c1000000-55d4c2000000 rw-p 00000000 00:00 0          [heap]
7f0000000000-7f0040000000 r--s 00000000 08:01 200        /models/weights.safetensors
7f0040000000-7f0041000000 r--p 00000000 08:01 300        /usr/lib/locale/locale-archive
7f0041000000-7f0041028000 r--p 00000000 08:01 400        /usr/lib/lib c.so.6
7f0041028000-7f00411bd000 r-xp 00028000 08:01 400        /usr/lib/lib c.so.6
7f00411bd000-7f00411c0000 ---p 001bd000 08:01 400        /usr/lib/lib c.so.6
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0          [vdso]
";
        let regions = parse_maps(maps);
        let starts: Vec<usize> = regions.iter().map(|r| r.addr).collect();
        assert_eq!(
            starts,
            vec![
                0x55d4c0000000,
                0x55d4c0010000,
                0x55d4c0050000,
                0x7f0041000000,
                0x7f0041028000
            ]
        );
        assert_eq!(regions[1].len, 0x40000);
        assert!(regions.iter().all(|r| r.kind == crate::RegionKind::Host));
    }

    #[test]
    fn this_process_has_code_mapped() {
        let regions = executable_regions();
        if std::path::Path::new("/proc/self/maps").exists() {
            let exe = regions.iter().map(|r| r.len).sum::<usize>();
            assert!(exe > 0, "no code mappings found");
            let here = executable_regions as *const () as usize;
            assert!(
                regions.iter().any(|r| (r.addr..r.end()).contains(&here)),
                "this function's own code is not in the list"
            );
        } else {
            assert!(regions.is_empty());
        }
    }
}
