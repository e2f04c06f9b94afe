//! `strftime_now(format)` for templates (Llama 3 style "Today Date: 26 Jul 2024"). Uses UTC:
//! the server has no reliable notion of the user's zone, and transformers' local time on a server
//! is just as arbitrary. Supports %Y %y %m %d %e %H %I %M %S %p %B %b %h %A %a %j %F %T %D %%,
//! and glibc's "-" flag (no padding, e.g. %-d). Unknown directives print as written.

use std::time::{SystemTime, UNIX_EPOCH};

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
const DAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Broken-down UTC time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tm {
    pub year: i64,
    pub month: u32, // 1..=12
    pub day: u32,   // 1..=31
    pub hour: u32,
    pub minute: u32,
    pub second: u32,
    pub weekday: u32, // 0 = Monday
    pub yday: u32,    // 1..=366
}

pub(crate) fn now_utc() -> Tm {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    from_unix(secs)
}

/// Howard Hinnant's days-to-civil algorithm.
pub(crate) fn from_unix(secs: i64) -> Tm {
    let days = secs.div_euclid(86_400);
    let sod = secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [u32; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + u32::from(leap && month > 2);
    Tm {
        year,
        month,
        day,
        hour: (sod / 3600) as u32,
        minute: (sod / 60 % 60) as u32,
        second: (sod % 60) as u32,
        weekday: (days + 3).rem_euclid(7) as u32, // 1970-01-01 was a Thursday
        yday,
    }
}

pub(crate) fn format(tm: &Tm, fmt: &str) -> String {
    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let no_pad = chars.peek() == Some(&'-');
        if no_pad {
            chars.next();
        }
        let num = |v: i64, width: usize| {
            if no_pad {
                v.to_string()
            } else {
                format!("{v:0width$}")
            }
        };
        let hour12 = match tm.hour % 12 {
            0 => 12,
            h => h,
        };
        match chars.next() {
            Some('Y') => out.push_str(&tm.year.to_string()),
            Some('y') => out.push_str(&num(tm.year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(tm.month.into(), 2)),
            Some('d') => out.push_str(&num(tm.day.into(), 2)),
            Some('e') => out.push_str(&if no_pad {
                tm.day.to_string()
            } else {
                format!("{:2}", tm.day)
            }),
            Some('H') => out.push_str(&num(tm.hour.into(), 2)),
            Some('I') => out.push_str(&num(hour12.into(), 2)),
            Some('M') => out.push_str(&num(tm.minute.into(), 2)),
            Some('S') => out.push_str(&num(tm.second.into(), 2)),
            Some('p') => out.push_str(if tm.hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(MONTHS[(tm.month - 1) as usize]),
            Some('b') | Some('h') => out.push_str(&MONTHS[(tm.month - 1) as usize][..3]),
            Some('A') => out.push_str(DAYS[tm.weekday as usize]),
            Some('a') => out.push_str(&DAYS[tm.weekday as usize][..3]),
            Some('j') => out.push_str(&num(tm.yday.into(), 3)),
            Some('F') => out.push_str(&format!("{}-{:02}-{:02}", tm.year, tm.month, tm.day)),
            Some('T') => out.push_str(&format!("{:02}:{:02}:{:02}", tm.hour, tm.minute, tm.second)),
            Some('D') => out.push_str(&format!(
                "{:02}/{:02}/{:02}",
                tm.month,
                tm.day,
                tm.year.rem_euclid(100)
            )),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if no_pad {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday, day 208 of a leap year.
        let tm = from_unix(1_722_000_000 - 1_722_000_000 % 86_400 + 13 * 3600 + 5 * 60 + 9);
        assert_eq!(format(&tm, "%d %b %Y"), "26 Jul 2024");
        assert_eq!(
            format(&tm, "%A, %B %-d, %Y %I:%M:%S %p (%j) %F %%"),
            "Friday, July 26, 2024 01:05:09 PM (208) 2024-07-26 %"
        );
        assert_eq!(format(&from_unix(0), "%Y-%m-%d %a"), "1970-01-01 Thu");
        assert_eq!(format(&from_unix(951_782_400), "%F %j"), "2000-02-29 060");
    }
}
