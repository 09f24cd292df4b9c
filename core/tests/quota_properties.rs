//! Property tests of the quota maths: random sequences of admissions, settlements and clock
//! steps (across UTC midnights and month ends) checked against a plain model of what each
//! window should hold.
#![allow(clippy::unwrap_used)]

use harvest_core::clock::{Day, Month, UnixMillis};
use harvest_core::quota::{AccountLimits, Admitted, Book, Denial, Lane};
use proptest::prelude::*;

/// 2026-01-31T22:00:00Z: a day and a month end are two hours away.
const START: UnixMillis = UnixMillis(1_769_896_800_000);

#[derive(Debug, Clone)]
enum Op {
    Admit {
        job: u8,
        key: u8,
        large: bool,
        tokens: u64,
    },
    Settle {
        job: u8,
        /// Per mille of the hold that is charged.
        per_mille: u64,
    },
    Advance {
        millis: i64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..24, 0u8..3, any::<bool>(), 0u64..4_000).prop_map(|(job, key, large, tokens)| Op::Admit { job, key, large, tokens }),
        3 => (0u8..24, 0u64..=1000).prop_map(|(job, per_mille)| Op::Settle { job, per_mille }),
        1 => (0i64..14_400_000).prop_map(|millis| Op::Advance { millis }),
    ]
}

fn limits() -> AccountLimits {
    AccountLimits {
        small_concurrency: 3,
        large_concurrency: 1,
        daily_tokens: Some(20_000),
        monthly_tokens: Some(60_000),
        total_tokens: Some(150_000),
        monthly_jobs_per_key: 9,
    }
}

/// What the books should say, kept the plain way: every charge with the windows it fell in,
/// every open hold with the windows it was taken in.
#[derive(Default)]
struct Model {
    charges: Vec<(u64, Day, Month)>,
    holds: Vec<(String, u64, Lane, Day, Month)>,
    admitted: Vec<(u8, Month)>,
}

impl Model {
    fn sum(&self, day: Option<Day>, month: Option<Month>) -> u64 {
        let charged: u64 = self
            .charges
            .iter()
            .filter(|(_, d, m)| day.is_none_or(|x| x == *d) && month.is_none_or(|x| x == *m))
            .map(|c| c.0)
            .sum();
        let held: u64 = self
            .holds
            .iter()
            .filter(|(_, _, _, d, m)| day.is_none_or(|x| x == *d) && month.is_none_or(|x| x == *m))
            .map(|h| h.1)
            .sum();
        charged + held
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn lanes_are_never_exceeded_and_every_window_equals_its_charges_and_holds(ops in proptest::collection::vec(op(), 1..120)) {
        let limits = limits();
        let mut now = START;
        let mut book = Book::new(now);
        let mut model = Model::default();
        for op in ops {
            match op {
                Op::Admit { job, key, large, tokens } => {
                    let lane = if large { Lane::Large } else { Lane::Small };
                    let id = format!("job-{job}");
                    let key_name = format!("key-{key}");
                    let already = model.holds.iter().any(|h| h.0 == id);
                    match book.admit(&id, &key_name, &limits, lane, tokens, now) {
                        Ok(Admitted::AlreadyHeld) => prop_assert!(already),
                        Ok(Admitted::New) => {
                            prop_assert!(!already);
                            model.holds.push((id, tokens, lane, now.day(), now.month()));
                            model.admitted.push((key, now.month()));
                        }
                        Err(Denial::Concurrency { lane: denied, .. }) => prop_assert_eq!(denied, lane),
                        Err(Denial::JobQuota { limit }) => {
                            let this_month = model.admitted.iter().filter(|(k, m)| *k == key && *m == now.month()).count();
                            prop_assert_eq!(this_month as u32, limit);
                        }
                        Err(Denial::Budget { limit, used, requested, .. }) => prop_assert!(used + requested > limit),
                    }
                }
                Op::Settle { job, per_mille } => {
                    let id = format!("job-{job}");
                    let position = model.holds.iter().position(|h| h.0 == id);
                    let tokens = position.map_or(0, |p| model.holds[p].1);
                    let charge = tokens * per_mille / 1000;
                    prop_assert_eq!(book.settle(&id, charge, now), position.is_some());
                    prop_assert!(!book.settle(&id, charge, now), "a second settlement must change nothing");
                    if let Some(p) = position {
                        model.holds.swap_remove(p);
                        model.charges.push((charge, now.day(), now.month()));
                    }
                }
                Op::Advance { millis } => {
                    now = now.plus_millis(millis);
                    book.roll(now);
                }
            }
            let ledger = &book.ledger;
            prop_assert!(ledger.active_small <= limits.small_concurrency);
            prop_assert!(ledger.active_large <= limits.large_concurrency);
            let running = |lane| model.holds.iter().filter(|h| h.2 == lane).count() as u32;
            prop_assert_eq!(ledger.active_small, running(Lane::Small));
            prop_assert_eq!(ledger.active_large, running(Lane::Large));
            prop_assert_eq!(ledger.day, now.day());
            prop_assert_eq!(ledger.month, now.month());
            prop_assert_eq!(ledger.tokens_today, model.sum(Some(now.day()), None));
            prop_assert_eq!(ledger.tokens_month, model.sum(None, Some(now.month())));
            prop_assert_eq!(ledger.tokens_total, model.sum(None, None));
        }
    }

    #[test]
    fn windows_roll_exactly_at_utc_midnight_and_the_first_of_the_month(offset in 0i64..(400 * 86_400_000)) {
        let t = START.plus_millis(offset);
        let day = t.day();
        prop_assert!(day.start() <= t && t < day.end());
        prop_assert_eq!(day.start().0 % 86_400_000, 0);
        prop_assert_eq!(day.end().plus_millis(-1).day(), day);
        prop_assert_ne!(day.end().day(), day);
        let month = t.month();
        prop_assert!(month.start() <= t && t < month.end());
        prop_assert_eq!(month.start().day().day, 1);
        prop_assert_ne!(month.end().month(), month);

        let mut book = Book::new(t);
        let hold_limits = AccountLimits { monthly_jobs_per_key: 1, ..limits() };
        book.admit("a", "k", &hold_limits, Lane::Small, 100, t).unwrap();
        book.settle("a", 100, t);
        let last_ms_of_day = day.end().plus_millis(-1);
        book.roll(last_ms_of_day);
        prop_assert_eq!(book.ledger.tokens_today, 100);
        book.roll(day.end());
        prop_assert_eq!(book.ledger.tokens_today, 0);
        prop_assert_eq!(book.ledger.tokens_month, if day.end().month() == month { 100 } else { 0 });
        // The key's monthly job count resets with the month, not the day.
        let quota_left = book.check(&hold_limits, "k", Lane::Small, 1, day.end()).is_ok();
        prop_assert_eq!(quota_left, day.end().month() != month);
        prop_assert!(book.check(&hold_limits, "k", Lane::Small, 1, month.end()).is_ok());
    }

    /// Several controllers reconcile the same jobs against one account's books through an
    /// optimistic store (read a version, decide, write only if the version is unchanged), in
    /// random interleavings. Each controller also has its own, possibly stale, view of which
    /// jobs have finished (a watch cache), so it may try to admit a job that finished and was
    /// settled since: only the check of the job's current state (the operator's GET of the
    /// apiserver's copy before a hold) stops it. The limits hold, and every finished job is
    /// charged exactly once.
    #[test]
    fn optimistic_concurrent_admissions_never_overbook_or_double_charge(
        schedule in proptest::collection::vec((0usize..4, 0u8..6, 0u8..4), 1..300)
    ) {
        let limits = AccountLimits { small_concurrency: 2, daily_tokens: Some(20_000), ..limits() };
        let mut version = 0u64;
        let mut stored = serde_json::to_string(&Book::new(START)).unwrap();
        let mut finished = std::collections::BTreeSet::new();
        let mut charges = 0u64;
        let mut books: Vec<Option<(u64, Book)>> = (0..4).map(|_| None).collect();
        let mut job_views: Vec<std::collections::BTreeSet<String>> = (0..4).map(|_| Default::default()).collect();
        for (who, job, step) in schedule {
            let id = format!("job-{job}");
            match step {
                // The controller's job cache catches up.
                0 => job_views[who] = finished.clone(),
                // It reads the account's books.
                1 => books[who] = Some((version, serde_json::from_str(&stored).unwrap())),
                // It admits a job its cache shows waiting, or finishes (settles) one.
                _ => {
                    let Some((read, mut book)) = books[who].take() else { continue };
                    let settling = step == 3;
                    let changed = if settling {
                        book.settle(&id, 600, START)
                    } else if job_views[who].contains(&id) || finished.contains(&id) {
                        // The second test is the apiserver's copy of the job, read fresh.
                        false
                    } else {
                        book.admit(&id, "k", &limits, Lane::Small, 1_000, START) == Ok(Admitted::New)
                    };
                    if changed && read == version {
                        version += 1;
                        stored = serde_json::to_string(&book).unwrap();
                        if settling {
                            prop_assert!(finished.insert(id.clone()), "{id} was settled twice");
                            charges += 600;
                        }
                    }
                }
            }
            let book: Book = serde_json::from_str(&stored).unwrap();
            prop_assert!(book.ledger.active_small <= 2);
            prop_assert!(book.ledger.tokens_today <= 20_000);
            prop_assert_eq!(book.ledger.active_small as usize, book.holds.len());
            prop_assert_eq!(book.ledger.tokens_today, 1_000 * book.holds.len() as u64 + charges);
            prop_assert!(book.holds.keys().all(|held| !finished.contains(held)), "a finished job holds tokens again");
        }
    }
}
