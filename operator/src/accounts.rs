//! Which HarvestAccount pays for a job, and what its books owe: pure functions over the cached
//! accounts and jobs. A job in the API's namespace is charged to the account its
//! `harvest.dev/account` label names (only the API can create jobs there); any other job to the
//! one account that lists its namespace. A field a user writes is never trusted.

use std::collections::BTreeMap;

use harvest_core::Location;
use harvest_core::quota::{BudgetWindow, Denial};
use harvest_crds::conditions::{self, ADMITTED, FINISHED};
use harvest_crds::{ACCOUNT_LABEL, HarvestAccount, HarvestJob, KEY_LABEL};
use kube::ResourceExt;

/// The account a job is charged to and the key its monthly job count is kept under.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    /// The HarvestAccount's name.
    pub account: String,
    /// `key:<id>` for API jobs, `namespace:<ns>` for jobs applied directly.
    pub key: String,
}

/// Why no account pays for a job (it waits until one does).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unbound {
    /// No account lists the namespace.
    #[error(
        "no HarvestAccount pays for namespace {namespace:?}: add it to one account's spec.namespaces"
    )]
    NoAccount {
        /// The job's namespace.
        namespace: String,
    },
    /// Several accounts list the namespace.
    #[error(
        "namespace {namespace:?} is listed by several HarvestAccounts ({}): keep it in one",
        accounts.join(", ")
    )]
    Ambiguous {
        /// The namespace.
        namespace: String,
        /// The accounts listing it.
        accounts: Vec<String>,
    },
    /// An API job names an account that does not exist.
    #[error(
        "the HarvestAccount {account:?} named by the job's {ACCOUNT_LABEL} label does not exist"
    )]
    UnknownAccount {
        /// The label's value.
        account: String,
    },
}

impl Unbound {
    /// The `Admitted=False` reason.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NoAccount { .. } => "NoAccount",
            Self::Ambiguous { .. } => "AmbiguousAccount",
            Self::UnknownAccount { .. } => "UnknownAccount",
        }
    }
}

/// The account that pays for `job`.
pub fn bind(
    job: &HarvestJob,
    accounts: &[impl AsRef<HarvestAccount>],
    api_namespace: Option<&str>,
) -> Result<Binding, Unbound> {
    let namespace = job.namespace().unwrap_or_default();
    if api_namespace == Some(namespace.as_str()) {
        let account = job.labels().get(ACCOUNT_LABEL).cloned().unwrap_or_default();
        if !accounts.iter().any(|a| a.as_ref().name_any() == account) {
            return Err(Unbound::UnknownAccount { account });
        }
        let key = job.labels().get(KEY_LABEL).cloned().unwrap_or_default();
        return Ok(Binding {
            account,
            key: format!("key:{key}"),
        });
    }
    let mut payers: Vec<String> = accounts
        .iter()
        .map(AsRef::as_ref)
        .filter(|a| a.spec.namespaces.contains(&namespace))
        .map(ResourceExt::name_any)
        .collect();
    match payers.len() {
        0 => Err(Unbound::NoAccount { namespace }),
        1 => Ok(Binding {
            account: payers.remove(0),
            key: format!("namespace:{namespace}"),
        }),
        _ => {
            payers.sort();
            Err(Unbound::Ambiguous {
                namespace,
                accounts: payers,
            })
        }
    }
}

/// A job's `namespace/name`, how queues, holds and logs name it.
pub(crate) fn key_of(job: &HarvestJob) -> String {
    format!("{}/{}", job.namespace().unwrap_or_default(), job.name_any())
}

/// The verdict on a job that `account` remembers having run under the same name and spec
/// ([`harvest_crds::HarvestAccountStatus::ran_before`]): a copy a GitOps tool made after the
/// TTL deleted it, which ends as that run did.
pub fn already_ran(
    job: &HarvestJob,
    accounts: &[impl AsRef<HarvestAccount>],
    account: &str,
) -> Option<crate::decide::admission::Admission> {
    let paying = accounts
        .iter()
        .map(AsRef::as_ref)
        .find(|a| a.name_any() == account)?;
    let status = paying.status.as_ref()?;
    let key = key_of(job);
    let before = status.ran_before(&key, &job.spec.digest(), &job.uid()?)?;
    let settled = before.settled_at.0;
    Some(crate::decide::admission::Admission::AlreadyRan {
        phase: before.phase.clone(),
        message: format!(
            "{key} ran to its end before with this same spec (UID {}, {}, {} tokens charged, settled {settled}) and its TTL deleted it; this copy, from the same manifest, is not run or charged again. Its outputs are where spec.output says. To run it again, give the job another name or change its spec",
            before.uid, before.phase, before.charged
        ),
    })
}

/// The refusal of a job whose input or output lies outside its account's `storagePrefixes`
/// and `storage.prefix` (`None` when every location is inside one, or the account names
/// none).
pub fn storage_refusal(
    job: &HarvestJob,
    accounts: &[impl AsRef<HarvestAccount>],
    account: &str,
) -> Option<crate::decide::admission::Admission> {
    let paying = accounts
        .iter()
        .map(AsRef::as_ref)
        .find(|a| a.name_any() == account)?;
    let texts: Vec<&String> = paying
        .spec
        .storage_prefixes
        .iter()
        .chain(paying.spec.storage.as_ref().map(|s| &s.prefix))
        .collect();
    if texts.is_empty() {
        return None;
    }
    let refuse = |message: String| crate::decide::admission::Admission::Refuse {
        reason: "OutsideAccountStorage",
        message,
    };
    let mut roots = Vec::with_capacity(texts.len());
    for &text in &texts {
        match Location::parse(text, "storagePrefixes") {
            Ok(root) => roots.push(root),
            Err(_) => {
                return Some(refuse(format!(
                    "account {account:?} lists storage prefix {text:?}, which is not a location: its owner must write s3://bucket/prefix or an absolute path"
                )));
            }
        }
    }
    let spec = &job.spec;
    let locations = [
        ("output", spec.output.as_deref()),
        ("input.prompts", Some(spec.input.prompts.as_str())),
        ("input.directions", spec.input.directions.as_deref()),
    ];
    locations
        .into_iter()
        .filter_map(|(field, value)| Some((field, value?)))
        .find(|(_, value)| {
            !Location::parse(value, "location")
                .is_ok_and(|location| roots.iter().any(|root| location.is_within(root)))
        })
        .map(|(field, value)| {
            refuse(format!(
                "{field} {value:?} lies outside {}, where account {account:?} keeps its data: name a location under one of them",
                texts.iter().map(|t| t.as_str()).collect::<Vec<_>>().join(", ")
            ))
        })
}

/// The output the operator chooses for `job` (paid for by `account`) when its spec names none:
/// `<storage.prefix>/<namespace>/<name>-<uid>`, unique to the job. `None` when the job names
/// its own, or the account has no storage.
pub fn chosen_output(job: &HarvestJob, account: &HarvestAccount) -> Option<String> {
    if job.spec.output.is_some() {
        return None;
    }
    let prefix = &account.spec.storage.as_ref()?.prefix;
    Some(format!(
        "{}/{}/{}-{}",
        prefix.trim_end_matches('/'),
        job.namespace().unwrap_or_default(),
        job.name_any(),
        job.uid()?
    ))
}

/// The `Admitted=False` reason for a quota denial.
pub fn denial_reason(denial: &Denial) -> &'static str {
    match denial {
        Denial::Concurrency { .. } => "WaitingForAccountLane",
        Denial::JobQuota { .. } => "JobQuotaExhausted",
        Denial::Budget {
            window: BudgetWindow::Daily,
            ..
        } => "DailyBudgetExhausted",
        Denial::Budget {
            window: BudgetWindow::Monthly,
            ..
        } => "MonthlyBudgetExhausted",
        Denial::Budget {
            window: BudgetWindow::Total,
            ..
        } => "TotalBudgetExhausted",
    }
}

/// Whether a waiting job is held back by its account (budget, quota, binding) rather than by a
/// full cluster lane; such jobs do not block other accounts' jobs in the cluster queue.
pub fn blocked_by_account(job: &HarvestJob) -> bool {
    let status = job.status_or_default();
    conditions::get(&status.conditions, ADMITTED)
        .is_some_and(|c| c.status == "False" && c.reason != "WaitingForLane")
}

/// What a hold should be settled at, given its job as the cache has it (`None`: deleted).
/// `None` means keep it: the job still runs or is being admitted.
pub fn settlement(job: Option<&HarvestJob>, held: u64) -> Option<u64> {
    let Some(job) = job else {
        // Deleted before it was settled: treated as a cancel mid-run, charged the hold.
        return Some(held);
    };
    let status = job.status_or_default();
    if conditions::is_true(&status.conditions, FINISHED) {
        return Some(status.tokens.and_then(|t| t.charged).unwrap_or(0));
    }
    if job.spec.suspend && !conditions::is_true(&status.conditions, ADMITTED) {
        // Suspended: the slot is released and nothing is charged, as the decision says.
        return Some(0);
    }
    None
}

/// Settlements due on an account's holds: job UID → tokens to charge.
pub fn settlements<'a>(
    holds: impl IntoIterator<Item = (&'a String, u64)>,
    jobs_by_uid: &BTreeMap<String, &HarvestJob>,
) -> Vec<(String, u64)> {
    holds
        .into_iter()
        .filter_map(|(uid, held)| {
            settlement(jobs_by_uid.get(uid).copied(), held).map(|c| (uid.clone(), c))
        })
        .collect()
}

/// Whether `job` waits for admission (the account's `pendingJobs`).
pub fn is_pending(job: &HarvestJob) -> bool {
    let status = job.status_or_default();
    !job.spec.suspend
        && !job.spec.cancel
        && !conditions::is_true(&status.conditions, ADMITTED)
        && !conditions::is_true(&status.conditions, FINISHED)
}

#[cfg(test)]
mod tests {
    use super::*;
    use harvest_crds::{HarvestAccountSpec, HarvestJobSpec, HarvestJobStatus, TokenUsage};

    fn account(name: &str, namespaces: &[&str]) -> std::sync::Arc<HarvestAccount> {
        std::sync::Arc::new(HarvestAccount::new(
            name,
            HarvestAccountSpec::for_namespaces(namespaces),
        ))
    }

    fn job(namespace: &str, labels: &[(&str, &str)]) -> HarvestJob {
        let mut job = HarvestJob::new("j", HarvestJobSpec::new("m", "/p", "/o", 10));
        job.metadata.namespace = Some(namespace.into());
        job.metadata.labels = Some(
            labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        );
        job
    }

    #[test]
    fn a_job_without_an_output_gets_one_of_its_own_under_the_accounts_storage() {
        let mut spec = HarvestAccountSpec::for_namespaces(&["a"]);
        spec.storage = Some(harvest_crds::account::AccountStorage {
            prefix: "s3://harvest/teams/a/".into(),
            credentials_secret: None,
        });
        let account = HarvestAccount::new("team-a", spec);
        let mut job = job("a", &[]);
        job.metadata.uid = Some("0a1b".into());
        assert_eq!(chosen_output(&job, &account), None, "the spec names one");
        job.spec.output = None;
        assert_eq!(
            chosen_output(&job, &account).as_deref(),
            Some("s3://harvest/teams/a/a/j-0a1b")
        );
        // The chosen output lies within the account's storage; inputs must too.
        job.spec.output = chosen_output(&job, &account);
        job.spec.input.prompts = "s3://harvest/teams/a/in.jsonl".into();
        let accounts = [std::sync::Arc::new(account.clone())];
        assert_eq!(storage_refusal(&job, &accounts, "team-a"), None);
        job.spec.input.prompts = "s3://harvest/teams/b/in.jsonl".into();
        assert!(storage_refusal(&job, &accounts, "team-a").is_some());
        let bare = HarvestAccount::new("team-a", HarvestAccountSpec::for_namespaces(&["a"]));
        job.spec.output = None;
        assert_eq!(chosen_output(&job, &bare), None);
    }

    #[test]
    fn a_job_reading_or_writing_outside_its_accounts_storage_prefix_is_refused_naming_both() {
        let mut spec = HarvestAccountSpec::for_namespaces(&["a"]);
        spec.storage_prefixes = vec!["s3://harvest/teams/a".into(), "s3://inputs/a".into()];
        let accounts = [std::sync::Arc::new(HarvestAccount::new("team-a", spec))];
        let mut job = job("a", &[]);
        job.spec.input.prompts = "s3://inputs/a/in.jsonl".into();
        job.spec.output = Some("s3://harvest/teams/a/out/j".into());
        assert_eq!(storage_refusal(&job, &accounts, "team-a"), None);
        job.spec.output = Some("s3://harvest".into());
        let Some(crate::decide::admission::Admission::Refuse { reason, message }) =
            storage_refusal(&job, &accounts, "team-a")
        else {
            panic!("the whole bucket was allowed")
        };
        assert_eq!(reason, "OutsideAccountStorage");
        assert!(
            message.contains("output \"s3://harvest\"") && message.contains("teams/a"),
            "{message}"
        );
        job.spec.output = Some("s3://harvest/teams/a/out".into());
        job.spec.input.directions = Some("s3://harvest/teams/b/d.npy".into());
        assert!(storage_refusal(&job, &accounts, "team-a").is_some());
        // An account without a prefix refuses nothing.
        let open = [account("team-a", &["a"])];
        assert_eq!(storage_refusal(&job, &open, "team-a"), None);
    }

    #[test]
    fn a_job_recreated_under_the_name_and_spec_of_one_that_ran_is_known_and_another_is_not() {
        let mut ran = job("a", &[]);
        ran.metadata.uid = Some("old".into());
        let mut paying = HarvestAccount::new("team-a", HarvestAccountSpec::for_namespaces(&["a"]));
        let mut status = harvest_crds::HarvestAccountStatus::default();
        status.remember_ran(harvest_crds::account::RanEntry {
            uid: "old".into(),
            job: "a/j".into(),
            spec_digest: ran.spec.digest(),
            phase: "Succeeded".into(),
            charged: 77,
            settled_at: k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
        });
        paying.status = Some(status);
        let accounts = [std::sync::Arc::new(paying)];
        let mut copy = ran.clone();
        copy.metadata.uid = Some("new".into());
        let Some(crate::decide::admission::Admission::AlreadyRan { phase, message }) =
            already_ran(&copy, &accounts, "team-a")
        else {
            panic!("the copy was not recognised")
        };
        assert_eq!(phase, "Succeeded");
        assert!(
            message.contains("77 tokens") && message.contains("another name"),
            "{message}"
        );
        assert!(
            already_ran(&ran, &accounts, "team-a").is_none(),
            "the run itself"
        );
        copy.spec.harvest.shard_size = 8;
        assert!(
            already_ran(&copy, &accounts, "team-a").is_none(),
            "an edited spec runs"
        );
    }

    #[test]
    fn a_namespace_binds_to_the_one_account_listing_it_and_a_label_there_is_ignored() {
        let accounts = [account("team-a", &["a"]), account("team-b", &["b"])];
        let spoofed = job("a", &[(ACCOUNT_LABEL, "team-b")]);
        assert_eq!(
            bind(&spoofed, &accounts, Some("harvest-api")),
            Ok(Binding {
                account: "team-a".into(),
                key: "namespace:a".into()
            })
        );
        let unbound = bind(&job("c", &[]), &accounts, None).unwrap_err();
        assert_eq!(unbound.reason(), "NoAccount");
        assert!(unbound.to_string().contains("\"c\""), "{unbound}");
        let twice = [account("x", &["a"]), account("y", &["a"])];
        assert_eq!(
            bind(&job("a", &[]), &twice, None).unwrap_err().reason(),
            "AmbiguousAccount"
        );
    }

    #[test]
    fn api_jobs_are_charged_to_their_label_only_in_the_api_namespace() {
        let accounts = [account("team-a", &["a"])];
        let rest = job(
            "harvest-api",
            &[(ACCOUNT_LABEL, "team-a"), (KEY_LABEL, "ab12")],
        );
        assert_eq!(
            bind(&rest, &accounts, Some("harvest-api")),
            Ok(Binding {
                account: "team-a".into(),
                key: "key:ab12".into()
            })
        );
        let ghost = job("harvest-api", &[(ACCOUNT_LABEL, "ghost")]);
        assert_eq!(
            bind(&ghost, &accounts, Some("harvest-api")),
            Err(Unbound::UnknownAccount {
                account: "ghost".into()
            })
        );
    }

    #[test]
    fn holds_settle_at_the_charge_of_finished_jobs_and_stay_for_running_ones() {
        let running = job("a", &[]);
        let mut finished = job("a", &[]);
        let mut status = HarvestJobStatus::default();
        conditions::set(
            &mut status.conditions,
            conditions::ConditionUpdate {
                type_: FINISHED,
                status: true,
                reason: "Succeeded",
                message: String::new(),
            },
            None,
            &k8s_openapi::apimachinery::pkg::apis::meta::v1::Time(
                k8s_openapi::jiff::Timestamp::UNIX_EPOCH,
            ),
        );
        status.tokens = Some(TokenUsage {
            reserved: 10,
            charged: Some(7),
        });
        finished.status = Some(status);
        assert_eq!(settlement(Some(&running), 10), None);
        assert_eq!(settlement(Some(&finished), 10), Some(7));
        assert_eq!(settlement(None, 10), Some(10));
        let mut suspended = job("a", &[]);
        suspended.spec.suspend = true;
        assert_eq!(settlement(Some(&suspended), 10), Some(0));
    }
}
