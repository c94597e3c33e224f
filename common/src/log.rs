//! Log lines on stderr, one event a line: a UTC timestamp (RFC 3339, in
//! milliseconds), the process's name, then the message, e.g.
//! `2026-11-26T07:40:01.123Z worker mac-mini-1: registered with 10.0.0.2:7070`.
//!
//! Several workers' logs end up interleaved in one terminal, journal or
//! file, so every line says when and who. The name is set once at start
//! (`set_process_name`); `log!` works before that, under the binary's name.

use std::fmt;
use std::io::Write;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

static PROCESS_NAME: OnceLock<String> = OnceLock::new();

/// Names this process in every later line (first call wins).
pub fn set_process_name(name: impl Into<String>) {
    let _ = PROCESS_NAME.set(name.into());
}

/// The name lines carry: the one set, else the executable's short name.
pub fn process_name() -> &'static str {
    PROCESS_NAME.get_or_init(|| {
        let exe = std::env::args().next().unwrap_or_default();
        let base = exe.rsplit('/').next().unwrap_or_default();
        base.strip_prefix("tinyvllm-").unwrap_or(base).to_string()
    })
}

/// Writes one line; what `log!` expands to.
pub fn write_line(message: fmt::Arguments<'_>) {
    let line = format!("{} {}: {message}\n", timestamp(SystemTime::now()), process_name());
    // One write call, so concurrent lines do not interleave mid-line.
    let _ = std::io::stderr().lock().write_all(line.as_bytes());
}

/// A log line on stderr: `log!("registered as {id}")`.
#[macro_export]
macro_rules! log {
    ($($arg:tt)*) => {
        $crate::log::write_line(format_args!($($arg)*))
    };
}

/// `2026-11-26T07:40:01.123Z` for `time` (UTC; times before 1970 read as 1970).
pub fn timestamp(time: SystemTime) -> String {
    let since = time.duration_since(UNIX_EPOCH).unwrap_or_default();
    let (days, secs) = (since.as_secs() / 86_400, since.as_secs() % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60,
        since.subsec_millis()
    )
}

/// Days since 1970-01-01 to (year, month, day) in the proleptic Gregorian
/// calendar (Howard Hinnant's `civil_from_days`); also the chat templates'
/// `strftime_now`.
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let day_of_era = z.rem_euclid(146_097);
    let year_of_era = (day_of_era - day_of_era / 1460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let month_index = (5 * day_of_year + 2) / 153;
    let day = (day_of_year - (153 * month_index + 2) / 5 + 1) as u32;
    let month = if month_index < 10 { month_index + 3 } else { month_index - 9 } as u32;
    let year = year_of_era + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn at(secs: u64, millis: u64) -> String {
        timestamp(UNIX_EPOCH + Duration::from_secs(secs) + Duration::from_millis(millis))
    }

    #[test]
    fn timestamps_are_utc_rfc3339_in_milliseconds() {
        assert_eq!(at(0, 0), "1970-01-01T00:00:00.000Z");
        // `date -u -d @951782400`: a leap day in a year divisible by 400.
        assert_eq!(at(951_782_400, 7), "2000-02-29T00:00:00.007Z");
        assert_eq!(at(1_795_676_401, 123), "2026-11-26T07:00:01.123Z");
        assert_eq!(at(4_102_444_799, 999), "2099-12-31T23:59:59.999Z");
        // 2100 is not a leap year: Feb 28 is followed by Mar 1.
        assert_eq!(at(4_107_542_400, 0), "2100-03-01T00:00:00.000Z");
    }

    #[test]
    fn every_day_of_four_centuries_follows_the_previous() {
        let mut previous = civil_from_days(-1);
        for days in 0..146_097 {
            let (y, m, d) = civil_from_days(days);
            let next_day = (y, m, d) == (previous.0, previous.1, previous.2 + 1);
            let next_month = d == 1 && ((y, m) == (previous.0, previous.1 + 1) || (y, m) == (previous.0 + 1, 1));
            assert!(next_day || next_month, "{previous:?} -> {:?}", (y, m, d));
            previous = (y, m, d);
        }
    }
}
