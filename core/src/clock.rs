//! UTC calendar arithmetic on Unix times, enough for budget windows and ISO 8601 timestamps,
//! without a date library (this crate has no I/O and reads no clock: callers pass `now`).

use serde::{Deserialize, Serialize};

/// Milliseconds since the Unix epoch, UTC.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct UnixMillis(pub i64);

/// A UTC calendar day.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Day {
    /// Year.
    pub year: i32,
    /// Month, 1 to 12.
    pub month: u32,
    /// Day of the month, 1 to 31.
    pub day: u32,
}

/// A UTC calendar month.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Month {
    /// Year.
    pub year: i32,
    /// Month, 1 to 12.
    pub month: u32,
}

const MILLIS_PER_DAY: i64 = 86_400_000;

/// The civil date of a count of days since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i32, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = (yoe + era * 400 + i64::from(month <= 2)) as i32;
    (year, month, day)
}

/// Days since 1970-01-01 of a civil date.
fn days_from_civil(year: i32, month: u32, day: u32) -> i64 {
    let y = i64::from(year) - i64::from(month <= 2);
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

impl UnixMillis {
    /// The UTC day this instant falls in.
    pub fn day(self) -> Day {
        let (year, month, day) = civil_from_days(self.0.div_euclid(MILLIS_PER_DAY));
        Day { year, month, day }
    }

    /// The UTC month this instant falls in.
    pub fn month(self) -> Month {
        let Day { year, month, .. } = self.day();
        Month { year, month }
    }

    /// ISO 8601 in UTC with milliseconds and an explicit offset: `2026-11-03T09:30:00.123+00:00`.
    pub fn to_iso8601(self) -> String {
        let Day { year, month, day } = self.day();
        let ms = self.0.rem_euclid(MILLIS_PER_DAY);
        let (h, m, s, milli) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
        format!("{year:04}-{month:02}-{day:02}T{h:02}:{m:02}:{s:02}.{milli:03}+00:00")
    }

    /// The instant `millis` later.
    pub fn plus_millis(self, millis: i64) -> Self {
        Self(self.0 + millis)
    }
}

impl Day {
    /// The first millisecond of the day.
    pub fn start(self) -> UnixMillis {
        UnixMillis(days_from_civil(self.year, self.month, self.day) * MILLIS_PER_DAY)
    }

    /// The first millisecond of the next day.
    pub fn end(self) -> UnixMillis {
        self.start().plus_millis(MILLIS_PER_DAY)
    }
}

impl Month {
    /// The first millisecond of the month.
    pub fn start(self) -> UnixMillis {
        UnixMillis(days_from_civil(self.year, self.month, 1) * MILLIS_PER_DAY)
    }

    /// The first millisecond of the next month.
    pub fn end(self) -> UnixMillis {
        let (year, month) = if self.month == 12 {
            (self.year + 1, 1)
        } else {
            (self.year, self.month + 1)
        };
        Month { year, month }.start()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_instants_format_as_iso_8601_with_milliseconds() {
        assert_eq!(UnixMillis(0).to_iso8601(), "1970-01-01T00:00:00.000+00:00");
        // 2026-11-03T09:30:00.123Z
        assert_eq!(
            UnixMillis(1_793_698_200_123).to_iso8601(),
            "2026-11-03T09:30:00.123+00:00"
        );
        assert_eq!(
            UnixMillis(951_782_400_000).to_iso8601(),
            "2000-02-29T00:00:00.000+00:00"
        );
    }

    #[test]
    fn day_and_month_windows_roll_over_at_utc_midnight() {
        let last_ms_of_january = Month {
            year: 2026,
            month: 2,
        }
        .start()
        .plus_millis(-1);
        assert_eq!(
            last_ms_of_january.month(),
            Month {
                year: 2026,
                month: 1
            }
        );
        assert_eq!(
            last_ms_of_january.plus_millis(1).month(),
            Month {
                year: 2026,
                month: 2
            }
        );
        assert_eq!(
            last_ms_of_january.day().end(),
            Month {
                year: 2026,
                month: 2
            }
            .start()
        );
        assert_eq!(
            Month {
                year: 2026,
                month: 12
            }
            .end(),
            Month {
                year: 2027,
                month: 1
            }
            .start()
        );
    }

    #[test]
    fn civil_dates_round_trip_over_four_centuries() {
        let mut days = -146_097 * 2;
        while days < 146_097 * 2 {
            let (y, m, d) = civil_from_days(days);
            assert_eq!(days_from_civil(y, m, d), days, "{y}-{m}-{d}");
            days += 17;
        }
    }
}
