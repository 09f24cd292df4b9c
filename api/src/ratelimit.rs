//! The per-key request rate limit, on every route and both backends: a token bucket for each
//! bearer key a request carries (known or not, so junk keys are limited before they are looked
//! up), refilled at `requests_per_second` up to `burst`. Past it a request is answered 429
//! `rate_limited` with the seconds until the next token in `Retry-After`. Pure: the caller
//! passes the time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use serde::Deserialize;

/// Keys tracked at once. Past it, buckets that have refilled are forgotten (they hold nothing
/// a fresh bucket would not); if every bucket is still draining, a new key goes untracked
/// until one refills, which favours availability over a flood of distinct keys (those are
/// cheap: see `lookups.rs`).
pub const TRACKED_KEYS: usize = 65_536;

/// The limit, from the configuration's `rate_limit` (`null` turns it off).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct RateLimit {
    /// Sustained requests per second per key.
    pub requests_per_second: f64,
    /// Requests a key may make at once after being idle.
    pub burst: u32,
}

impl Default for RateLimit {
    fn default() -> Self {
        Self {
            requests_per_second: 50.0,
            burst: 100,
        }
    }
}

impl RateLimit {
    /// Why the limit cannot work, if it cannot.
    pub fn check(&self) -> Result<(), String> {
        if !(self.requests_per_second.is_finite() && self.requests_per_second > 0.0) {
            return Err(format!(
                "rate_limit.requests_per_second is {}: give a positive number, or set rate_limit to null to turn the limit off",
                self.requests_per_second
            ));
        }
        if self.burst == 0 {
            return Err(
                "rate_limit.burst is 0, which refuses every request: give at least 1".into(),
            );
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// Every key's bucket.
#[derive(Debug)]
pub struct RateLimiter {
    limit: RateLimit,
    buckets: HashMap<String, Bucket>,
}

impl RateLimiter {
    /// A limiter with no key seen yet.
    pub fn new(limit: RateLimit) -> Self {
        Self {
            limit,
            buckets: HashMap::new(),
        }
    }

    fn refilled(&self, bucket: Bucket, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
        (bucket.tokens + elapsed * self.limit.requests_per_second).min(f64::from(self.limit.burst))
    }

    /// Takes one request of `key`'s allowance, or says how long until it has one.
    pub fn take(&mut self, key: &str, now: Instant) -> Result<(), Duration> {
        let burst = f64::from(self.limit.burst);
        let tokens = match self.buckets.get(key) {
            Some(&bucket) => self.refilled(bucket, now),
            None => {
                if self.buckets.len() >= TRACKED_KEYS {
                    let limiter = &*self;
                    let draining: HashMap<String, Bucket> = limiter
                        .buckets
                        .iter()
                        .filter(|(_, b)| limiter.refilled(**b, now) < burst)
                        .map(|(k, b)| (k.clone(), *b))
                        .collect();
                    self.buckets = draining;
                    if self.buckets.len() >= TRACKED_KEYS {
                        return Ok(());
                    }
                }
                burst
            }
        };
        if tokens >= 1.0 {
            self.buckets.insert(
                key.to_owned(),
                Bucket {
                    tokens: tokens - 1.0,
                    at: now,
                },
            );
            return Ok(());
        }
        self.buckets
            .insert(key.to_owned(), Bucket { tokens, at: now });
        Err(Duration::from_secs_f64(
            (1.0 - tokens) / self.limit.requests_per_second,
        ))
    }

    /// The limit applied.
    pub fn limit(&self) -> RateLimit {
        self.limit
    }

    /// Keys tracked now.
    pub fn tracked(&self) -> usize {
        self.buckets.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMIT: RateLimit = RateLimit {
        requests_per_second: 2.0,
        burst: 3,
    };

    #[test]
    fn a_key_gets_its_burst_then_one_request_per_refill_and_others_are_unaffected() {
        let start = Instant::now();
        let mut limiter = RateLimiter::new(LIMIT);
        for _ in 0..3 {
            assert_eq!(limiter.take("a", start), Ok(()));
        }
        assert_eq!(limiter.take("a", start), Err(Duration::from_millis(500)));
        assert_eq!(
            limiter.take("b", start),
            Ok(()),
            "another key has its own bucket"
        );
        let later = start + Duration::from_millis(500);
        assert_eq!(limiter.take("a", later), Ok(()));
        assert!(limiter.take("a", later).is_err());
        // Idle long enough, the bucket is full again, and no fuller.
        let idle = later + Duration::from_secs(60);
        for _ in 0..3 {
            assert_eq!(limiter.take("a", idle), Ok(()));
        }
        assert!(limiter.take("a", idle).is_err());
    }

    #[test]
    fn refused_requests_do_not_push_the_next_allowed_one_further_away() {
        let start = Instant::now();
        let mut limiter = RateLimiter::new(LIMIT);
        for _ in 0..3 {
            limiter.take("a", start).unwrap();
        }
        let mut at = start;
        for _ in 0..10 {
            at += Duration::from_millis(10);
            assert!(limiter.take("a", at).is_err());
        }
        assert_eq!(
            limiter.take("a", start + Duration::from_millis(500)),
            Ok(())
        );
    }

    #[test]
    fn the_limiter_tracks_at_most_its_capacity_and_forgets_refilled_keys_first() {
        let start = Instant::now();
        let mut limiter = RateLimiter::new(LIMIT);
        for i in 0..TRACKED_KEYS {
            limiter.take(&format!("k{i}"), start).unwrap();
        }
        assert_eq!(limiter.tracked(), TRACKED_KEYS);
        // Every bucket still draining: a new key passes untracked.
        assert_eq!(limiter.take("new", start), Ok(()));
        assert_eq!(limiter.tracked(), TRACKED_KEYS);
        // Once they have refilled they are forgotten and the new key is tracked.
        let later = start + Duration::from_secs(1);
        assert_eq!(limiter.take("new", later), Ok(()));
        assert_eq!(limiter.tracked(), 1);
    }

    #[test]
    fn a_limit_that_cannot_work_is_refused_naming_the_fix() {
        assert!(RateLimit::default().check().is_ok());
        let zero = RateLimit {
            requests_per_second: 0.0,
            burst: 1,
        };
        assert!(zero.check().unwrap_err().contains("null"));
        let no_burst = RateLimit {
            requests_per_second: 1.0,
            burst: 0,
        };
        assert!(no_burst.check().unwrap_err().contains("at least 1"));
    }
}
