//! When the Kubernetes backend may ask the apiserver about a name its caches lack (an API key's
//! Secret, a job). The caches are the answer for nearly everything; a live lookup exists only
//! for objects made moments ago on another replica. So that unknown keys and job ids (junk
//! traffic, guessing) cost the apiserver next to nothing, a name the apiserver said is missing
//! is remembered for [`MISSING_TTL`], and live lookups share a small budget that refills at
//! [`LIVE_LOOKUPS_PER_SECOND`]. Pure: the caller passes the time.

use std::collections::{HashMap, VecDeque};
use std::time::{Duration, Instant};

/// How long a name the apiserver said is missing is answered as missing without asking again.
pub const MISSING_TTL: Duration = Duration::from_secs(10);
/// Missing names remembered at once; past it the oldest is forgotten.
pub const MISSING_CAPACITY: usize = 4096;
/// Live lookups per second, over every name (also the burst).
pub const LIVE_LOOKUPS_PER_SECOND: f64 = 10.0;

/// The negative cache and the live-lookup budget of one kind of name.
#[derive(Debug)]
pub struct Lookups {
    missing: HashMap<String, Instant>,
    /// Names in the order they were found missing, for eviction.
    order: VecDeque<(Instant, String)>,
    tokens: f64,
    refilled: Option<Instant>,
}

impl Default for Lookups {
    fn default() -> Self {
        Self {
            missing: HashMap::new(),
            order: VecDeque::new(),
            tokens: LIVE_LOOKUPS_PER_SECOND,
            refilled: None,
        }
    }
}

impl Lookups {
    /// Whether `name`, absent from the cache, may be looked up live now (which takes one
    /// lookup of the budget); `false` means: answer that it does not exist.
    pub fn may_look_up(&mut self, name: &str, now: Instant) -> bool {
        if self.missing.get(name).is_some_and(|&until| now < until) {
            return false;
        }
        let since = self
            .refilled
            .map_or(Duration::ZERO, |t| now.saturating_duration_since(t));
        self.tokens = (self.tokens + since.as_secs_f64() * LIVE_LOOKUPS_PER_SECOND)
            .min(LIVE_LOOKUPS_PER_SECOND);
        self.refilled = Some(now);
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }

    /// The apiserver said `name` does not exist.
    pub fn missing(&mut self, name: &str, now: Instant) {
        while let Some((since, _)) = self.order.front() {
            let expired = now.saturating_duration_since(*since) >= MISSING_TTL;
            if !expired && self.order.len() < MISSING_CAPACITY {
                break;
            }
            if let Some((since, old)) = self.order.pop_front()
                && self.missing.get(&old) == Some(&(since + MISSING_TTL))
            {
                self.missing.remove(&old);
            }
        }
        self.missing.insert(name.to_owned(), now + MISSING_TTL);
        self.order.push_back((now, name.to_owned()));
    }

    /// Names remembered as missing (for tests and metrics).
    pub fn remembered(&self) -> usize {
        self.missing.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_name_is_not_looked_up_again_until_its_ttl_passes() {
        let start = Instant::now();
        let mut lookups = Lookups::default();
        assert!(lookups.may_look_up("junk", start));
        lookups.missing("junk", start);
        let later = start + MISSING_TTL - Duration::from_millis(1);
        assert!(!lookups.may_look_up("junk", later));
        assert!(lookups.may_look_up("junk", start + MISSING_TTL));
    }

    #[test]
    fn distinct_names_share_a_budget_that_refills_with_time() {
        let start = Instant::now();
        let mut lookups = Lookups::default();
        let allowed = (0..1000)
            .filter(|i| lookups.may_look_up(&format!("junk-{i}"), start))
            .count();
        assert_eq!(allowed, LIVE_LOOKUPS_PER_SECOND as usize);
        let second = start + Duration::from_secs(1);
        let allowed = (0..1000)
            .filter(|i| lookups.may_look_up(&format!("more-{i}"), second))
            .count();
        assert_eq!(
            allowed, LIVE_LOOKUPS_PER_SECOND as usize,
            "refilled, not more"
        );
    }

    #[test]
    fn the_negative_cache_never_holds_more_than_its_capacity() {
        let start = Instant::now();
        let mut lookups = Lookups::default();
        for i in 0..MISSING_CAPACITY + 100 {
            lookups.missing(&format!("junk-{i}"), start);
        }
        assert_eq!(lookups.remembered(), MISSING_CAPACITY);
        // The newest are the ones kept.
        assert!(!lookups.may_look_up(&format!("junk-{}", MISSING_CAPACITY + 99), start));
        // Expired entries go first.
        lookups.missing("late", start + MISSING_TTL);
        assert_eq!(lookups.remembered(), 1);
    }
}
