//! Exact, mergeable per-dimension statistics: count, mean and sum of squared deviations in f64
//! (Welford for single rows, Chan et al. for merging partial results).
//!
//! Merging is deterministic: merging the same partials in the same order gives bit-identical
//! results, which is what lets a resumed harvest reproduce an uninterrupted one exactly.

/// Running statistics of rows of `width` values.
#[derive(Debug, Clone, PartialEq)]
pub struct RunningStats {
    count: u64,
    mean: Vec<f64>,
    m2: Vec<f64>,
    norm_sum: f64,
}

impl RunningStats {
    /// Empty statistics for rows of `width` values.
    pub fn new(width: usize) -> Self {
        Self {
            count: 0,
            mean: vec![0.0; width],
            m2: vec![0.0; width],
            norm_sum: 0.0,
        }
    }

    /// Rebuilds statistics from stored parts (e.g. a partial written by an earlier run).
    pub fn from_parts(count: u64, mean: Vec<f64>, m2: Vec<f64>, norm_sum: f64) -> Option<Self> {
        (mean.len() == m2.len()).then_some(Self {
            count,
            mean,
            m2,
            norm_sum,
        })
    }

    /// Adds one row.
    pub fn push(&mut self, row: &[f32]) {
        debug_assert_eq!(row.len(), self.mean.len());
        self.push_values(row.iter().copied());
    }

    /// Adds one row given as its values in order (one per mean: a row held in another type,
    /// widened as it is read).
    pub fn push_values(&mut self, row: impl IntoIterator<Item = f32>) {
        self.count += 1;
        let n = self.count as f64;
        let mut sq = 0.0;
        for ((mean, m2), x) in self.mean.iter_mut().zip(&mut self.m2).zip(row) {
            let x = f64::from(x);
            sq += x * x;
            let delta = x - *mean;
            *mean += delta / n;
            *m2 += delta * (x - *mean);
        }
        self.norm_sum += sq.sqrt();
    }

    /// Folds `other` into `self` (Chan et al.).
    pub fn merge(&mut self, other: &Self) {
        if other.count == 0 {
            return;
        }
        if self.count == 0 {
            *self = other.clone();
            return;
        }
        let (na, nb) = (self.count as f64, other.count as f64);
        let n = na + nb;
        for i in 0..self.mean.len() {
            let delta = other.mean[i] - self.mean[i];
            self.mean[i] += delta * nb / n;
            self.m2[i] += other.m2[i] + delta * delta * na * nb / n;
        }
        self.count += other.count;
        self.norm_sum += other.norm_sum;
    }

    /// Rows seen.
    pub fn count(&self) -> u64 {
        self.count
    }

    /// Per-dimension mean.
    pub fn mean(&self) -> &[f64] {
        &self.mean
    }

    /// Per-dimension sum of squared deviations.
    pub fn m2(&self) -> &[f64] {
        &self.m2
    }

    /// Sum of row L2 norms.
    pub fn norm_sum(&self) -> f64 {
        self.norm_sum
    }

    /// Per-dimension population standard deviation (0 with no rows).
    pub fn std(&self) -> Vec<f64> {
        let n = self.count.max(1) as f64;
        self.m2.iter().map(|m2| (m2 / n).max(0.0).sqrt()).collect()
    }

    /// Mean row L2 norm (0 with no rows).
    pub fn mean_norm(&self) -> f64 {
        if self.count == 0 {
            0.0
        } else {
            self.norm_sum / self.count as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows() -> Vec<[f32; 2]> {
        (0..50)
            .map(|i| [i as f32 * 0.5 - 3.0, ((i * 7) % 11) as f32])
            .collect()
    }

    #[test]
    fn welford_matches_the_two_pass_formulas() {
        let mut stats = RunningStats::new(2);
        for row in rows() {
            stats.push(&row);
        }
        for d in 0..2 {
            let values: Vec<f64> = rows().iter().map(|r| f64::from(r[d])).collect();
            let mean = values.iter().sum::<f64>() / 50.0;
            let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / 50.0;
            assert!((stats.mean()[d] - mean).abs() < 1e-12);
            assert!((stats.std()[d] - var.sqrt()).abs() < 1e-12);
        }
        let norms: f64 = rows()
            .iter()
            .map(|r| f64::from(r[0]).hypot(f64::from(r[1])))
            .sum();
        assert!((stats.mean_norm() - norms / 50.0).abs() < 1e-12);
    }

    #[test]
    fn merging_partials_equals_one_pass_within_rounding() {
        let mut whole = RunningStats::new(2);
        let (mut a, mut b) = (RunningStats::new(2), RunningStats::new(2));
        for (i, row) in rows().iter().enumerate() {
            whole.push(row);
            if i < 17 { a.push(row) } else { b.push(row) }
        }
        a.merge(&b);
        assert_eq!(a.count(), 50);
        for d in 0..2 {
            assert!((a.mean()[d] - whole.mean()[d]).abs() < 1e-12);
            assert!((a.m2()[d] - whole.m2()[d]).abs() < 1e-9);
        }
    }

    #[test]
    fn merging_into_or_from_empty_is_the_identity() {
        let mut a = RunningStats::new(2);
        a.push(&[1.0, 2.0]);
        let snapshot = a.clone();
        a.merge(&RunningStats::new(2));
        assert_eq!(a, snapshot);
        let mut empty = RunningStats::new(2);
        empty.merge(&snapshot);
        assert_eq!(empty, snapshot);
    }
}
