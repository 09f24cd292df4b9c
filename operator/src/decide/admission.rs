//! Lane admission in Kueue's style: every job is created pending and is admitted, in creation
//! order within its lane, when the cluster's lane has a free slot; then its account's books
//! (`accounts`, `core::quota::Book`) must allow it too. Each account queues strictly in creation
//! order; a job its account holds back (budget, quota) does not block other accounts' jobs.
//! Pure: the controller passes the queue.

use harvest_core::quota::Lane;
use k8s_openapi::jiff::Timestamp;

/// A job as the queue sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueueEntry {
    /// `namespace/name`.
    pub key: String,
    /// The account that pays for it (empty when none does).
    pub account: String,
    /// Waiting because of its account rather than the cluster lane.
    pub blocked: bool,
    /// Its lane.
    pub lane: Lane,
    /// When it was created (the queue order; the key breaks ties).
    pub created: Timestamp,
    /// Where it stands.
    pub state: QueueState,
}

/// Where a job stands in its lane.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueState {
    /// Admitted and not finished: holds a slot.
    Active,
    /// Waiting for a slot.
    Waiting,
    /// Finished or suspended: neither holds nor wants a slot.
    Idle,
}

/// Whether a waiting job may start now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// A slot is free and no older job waits for it.
    Admit,
    /// Never: the job breaks a rule of its account (it fails, holding nothing).
    Refuse {
        /// CamelCase reason for the `Finished` condition.
        reason: &'static str,
        /// Why, and what to do.
        message: String,
    },
    /// Never: the same job (name and spec) ran to its end before, and its TTL deleted it;
    /// this one is a GitOps tool's copy. It ends as that run ended, running nothing and
    /// charged nothing.
    AlreadyRan {
        /// How that run ended: `Succeeded`, `Failed` or `Cancelled`.
        phase: String,
        /// What ran, and how to run it again.
        message: String,
    },
    /// Wait, for the reason given.
    Wait {
        /// CamelCase reason for the `Admitted=False` condition.
        reason: &'static str,
        /// What it waits for.
        message: String,
    },
}

/// The verdict for `me` (a waiting job in `lane`) given every job and the cluster lane's
/// capacity.
pub fn verdict(entries: &[QueueEntry], me: &QueueEntry, capacity: u32) -> Admission {
    let in_lane = entries
        .iter()
        .filter(|e| e.lane == me.lane && e.key != me.key);
    let mut active = 0u32;
    let mut ahead = 0u32;
    let mut ahead_in_account = 0u32;
    for entry in in_lane {
        let older = (entry.created, &entry.key) < (me.created, &me.key);
        match entry.state {
            QueueState::Active => active += 1,
            QueueState::Waiting if older && entry.account == me.account => ahead_in_account += 1,
            QueueState::Waiting if older && !entry.blocked => ahead += 1,
            QueueState::Waiting | QueueState::Idle => {}
        }
    }
    if ahead_in_account > 0 {
        return Admission::Wait {
            reason: "WaitingInAccountQueue",
            message: format!(
                "{ahead_in_account} older job(s) of account {:?} wait ahead in the {} lane",
                me.account, me.lane
            ),
        };
    }
    if active + ahead < capacity {
        Admission::Admit
    } else {
        Admission::Wait {
            reason: "WaitingForLane",
            message: format!(
                "the {} lane is full: {active} of {capacity} slots in use, {ahead} job(s) ahead in the queue",
                me.lane
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(name: &str, second: i64, state: QueueState) -> QueueEntry {
        QueueEntry {
            key: format!("ns/{name}"),
            account: format!("account-{name}"),
            blocked: false,
            lane: Lane::Small,
            created: Timestamp::from_second(second).unwrap(),
            state,
        }
    }

    #[test]
    fn a_free_lane_admits_and_a_full_one_names_its_occupancy() {
        let me = entry("me", 5, QueueState::Waiting);
        let one = [entry("a", 1, QueueState::Active)];
        assert_eq!(verdict(&one, &me, 2), Admission::Admit);
        let Admission::Wait { reason, message } = verdict(&one, &me, 1) else {
            panic!("admitted into a full lane")
        };
        assert_eq!(reason, "WaitingForLane");
        assert!(message.contains("1 of 1 slots"), "{message}");
    }

    #[test]
    fn older_waiting_jobs_go_first_and_other_lanes_do_not_count() {
        let me = entry("me", 5, QueueState::Waiting);
        let mut large = entry("big", 0, QueueState::Active);
        large.lane = Lane::Large;
        let entries = [
            entry("old", 1, QueueState::Waiting),
            entry("young", 9, QueueState::Waiting),
            large,
            entry("done", 0, QueueState::Idle),
        ];
        assert!(matches!(verdict(&entries, &me, 1), Admission::Wait { .. }));
        assert_eq!(verdict(&entries, &me, 2), Admission::Admit);
        assert_eq!(verdict(&entries, &entries[0], 1), Admission::Admit);
    }

    #[test]
    fn an_account_queues_in_order_and_its_budget_blocked_jobs_do_not_hold_up_others() {
        let me = entry("me", 5, QueueState::Waiting);
        let mut mine_older = entry("older", 1, QueueState::Waiting);
        mine_older.account = me.account.clone();
        mine_older.blocked = true;
        let Admission::Wait { reason, .. } = verdict(&[mine_older.clone()], &me, 4) else {
            panic!("jumped its own account's queue")
        };
        assert_eq!(reason, "WaitingInAccountQueue");
        let mut theirs_blocked = mine_older;
        theirs_blocked.account = "other".into();
        assert_eq!(verdict(&[theirs_blocked.clone()], &me, 1), Admission::Admit);
        theirs_blocked.blocked = false;
        assert!(matches!(
            verdict(&[theirs_blocked], &me, 1),
            Admission::Wait {
                reason: "WaitingForLane",
                ..
            }
        ));
    }

    /// Every ordering of `0..n` (Heap's algorithm).
    fn permutations(n: usize) -> Vec<Vec<usize>> {
        fn heap(k: usize, items: &mut Vec<usize>, out: &mut Vec<Vec<usize>>) {
            if k <= 1 {
                out.push(items.clone());
                return;
            }
            for i in 0..k {
                heap(k - 1, items, out);
                let j = if k.is_multiple_of(2) { i } else { 0 };
                items.swap(j, k - 1);
            }
        }
        let mut out = Vec::new();
        heap(n, &mut (0..n).collect(), &mut out);
        out
    }

    #[test]
    fn admitting_every_job_the_verdicts_allow_never_exceeds_the_capacity() {
        // Admit jobs one by one, as the controller does, for every one of the 720 orders in
        // which six jobs can arrive (their creation order) and be reconciled.
        let orders = permutations(6);
        assert_eq!(orders.len(), 720);
        for order in &orders {
            let mut entries: Vec<_> = order
                .iter()
                .enumerate()
                .map(|(i, &arrival)| entry(&format!("j{i}"), arrival as i64, QueueState::Waiting))
                .collect();
            for _ in 0..6 {
                for i in 0..entries.len() {
                    if entries[i].state == QueueState::Waiting
                        && verdict(&entries, &entries[i], 2) == Admission::Admit
                    {
                        entries[i].state = QueueState::Active;
                    }
                }
            }
            let active: Vec<i64> = entries
                .iter()
                .filter(|e| e.state == QueueState::Active)
                .map(|e| e.created.as_second())
                .collect();
            assert_eq!(active.len(), 2, "{order:?}");
            assert!(
                active.iter().all(|&created| created < 2),
                "the two oldest run first: {order:?}"
            );
        }
    }
}
