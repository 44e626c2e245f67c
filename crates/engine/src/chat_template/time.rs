//! The `strftime_now` function: Python's `datetime.now().strftime(fmt)`, local time, C locale.

use std::fmt::Write as _;

use minijinja::{Error, ErrorKind, Value};

pub(super) fn strftime_now(format: String) -> Result<Value, Error> {
    let now = local_now().map_err(|msg| Error::new(ErrorKind::InvalidOperation, msg))?;
    Ok(Value::from(format_time(&format, &now)))
}

/// A broken-down local time.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LocalTime {
    year: i64,
    /// 1..=12
    month: u32,
    /// 1..=31
    day: u32,
    hour: u32,
    minute: u32,
    second: u32,
    /// 0 = Sunday
    weekday: u32,
    /// 0-based day of the year
    yday: u32,
    microsecond: u32,
}

fn local_now() -> Result<LocalTime, String> {
    let since_epoch = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|_| "system clock is before 1970".to_owned())?;
    let t = libc::time_t::try_from(since_epoch.as_secs())
        .map_err(|_| "system clock out of range".to_owned())?;
    // SAFETY: `tm` is plain old data, so all-zero is a valid value.
    let mut tm: libc::tm = unsafe { std::mem::zeroed() };
    // SAFETY: both pointers are valid for the call; localtime_r is the
    // thread-safe variant and writes only into `tm`.
    if unsafe { libc::localtime_r(&t, &mut tm) }.is_null() {
        return Err("localtime_r failed".to_owned());
    }
    let field = |v: libc::c_int| u32::try_from(v).unwrap_or(0);
    Ok(LocalTime {
        year: i64::from(tm.tm_year) + 1900,
        month: field(tm.tm_mon) + 1,
        day: field(tm.tm_mday),
        hour: field(tm.tm_hour),
        minute: field(tm.tm_min),
        second: field(tm.tm_sec),
        weekday: field(tm.tm_wday),
        yday: field(tm.tm_yday),
        microsecond: since_epoch.subsec_micros(),
    })
}

const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];
const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];

/// C-locale strftime for the common directives, glibc's `%-d` style
/// no-padding flag, and Python's own `%f`. Unknown directives are copied
/// through, as glibc does.
fn format_time(format: &str, t: &LocalTime) -> String {
    let weekday = WEEKDAYS[(t.weekday % 7) as usize];
    let month = MONTHS[(t.month.clamp(1, 12) - 1) as usize];
    let hour12 = match t.hour % 12 {
        0 => 12,
        h => h,
    };
    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.next_if_eq(&'-').is_some();
        let Some(spec) = chars.next() else {
            out.push('%');
            if no_pad {
                out.push('-');
            }
            break;
        };
        // Zero-padded (or space-padded) number, unless the `-` flag was given.
        let num = |out: &mut String, v: i64, width: usize, pad: char| {
            let _ = match (no_pad, pad) {
                (true, _) => write!(out, "{v}"),
                (false, ' ') => write!(out, "{v:>width$}"),
                (false, _) => write!(out, "{v:0width$}"),
            };
        };
        match spec {
            'a' => out.push_str(&weekday[..3]),
            'A' => out.push_str(weekday),
            'b' | 'h' => out.push_str(&month[..3]),
            'B' => out.push_str(month),
            'd' => num(&mut out, t.day.into(), 2, '0'),
            'e' => num(&mut out, t.day.into(), 2, ' '),
            'm' => num(&mut out, t.month.into(), 2, '0'),
            'Y' => {
                let _ = write!(out, "{}", t.year);
            }
            'y' => num(&mut out, t.year.rem_euclid(100), 2, '0'),
            'C' => num(&mut out, t.year.div_euclid(100), 2, '0'),
            'H' => num(&mut out, t.hour.into(), 2, '0'),
            'k' => num(&mut out, t.hour.into(), 2, ' '),
            'I' => num(&mut out, hour12.into(), 2, '0'),
            'l' => num(&mut out, hour12.into(), 2, ' '),
            'M' => num(&mut out, t.minute.into(), 2, '0'),
            'S' => num(&mut out, t.second.into(), 2, '0'),
            'f' => num(&mut out, t.microsecond.into(), 6, '0'),
            'j' => num(&mut out, i64::from(t.yday) + 1, 3, '0'),
            'p' => out.push_str(if t.hour < 12 { "AM" } else { "PM" }),
            'P' => out.push_str(if t.hour < 12 { "am" } else { "pm" }),
            'u' => num(&mut out, (t.weekday + 6) as i64 % 7 + 1, 1, '0'),
            'w' => num(&mut out, t.weekday.into(), 1, '0'),
            // Week of the year, weeks starting on Sunday (%U) or Monday (%W).
            'U' => num(&mut out, (t.yday as i64 + 7 - t.weekday as i64) / 7, 2, '0'),
            'W' => num(
                &mut out,
                (t.yday as i64 + 7 - (t.weekday as i64 + 6) % 7) / 7,
                2,
                '0',
            ),
            'F' => out.push_str(&format_time("%Y-%m-%d", t)),
            'D' | 'x' => out.push_str(&format_time("%m/%d/%y", t)),
            'T' | 'X' => out.push_str(&format_time("%H:%M:%S", t)),
            'R' => out.push_str(&format_time("%H:%M", t)),
            'r' => out.push_str(&format_time("%I:%M:%S %p", t)),
            'c' => out.push_str(&format_time("%a %b %e %H:%M:%S %Y", t)),
            // datetime.now() is naive, so Python prints nothing for the zone.
            'z' | 'Z' => {}
            'n' => out.push('\n'),
            't' => out.push('\t'),
            '%' => out.push('%'),
            other => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strftime_directives() {
        let t = LocalTime {
            year: 2026,
            month: 3,
            day: 5,
            hour: 7,
            minute: 4,
            second: 9,
            weekday: 4,
            yday: 63,
            microsecond: 42,
        };
        assert_eq!(format_time("%d %b %Y", &t), "05 Mar 2026");
        assert_eq!(format_time("%B %-d, %Y %H:%M", &t), "March 5, 2026 07:04");
        assert_eq!(
            format_time("%A %a %m/%e %I%p %j %y %k|%l %P", &t),
            "Thursday Thu 03/ 5 07AM 064 26  7| 7 am"
        );
        assert_eq!(
            format_time("%F %T.%f [%z%Z] %% %Q %U %W %u %", &t),
            "2026-03-05 07:04:09.000042 [] % %Q 09 09 4 %"
        );
        assert_eq!(format_time("%c", &t), "Thu Mar  5 07:04:09 2026");
    }
}
