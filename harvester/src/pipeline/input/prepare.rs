//! Everything before the weights load: inputs read, the plan resolved against the model, the
//! corpus tokenized and checked against the budget, and what an earlier run left found.

use std::collections::BTreeMap;

use harvest_core::plan::shard_count;
use harvest_core::{HarvestPlan, ResolvedPlan};
use rayon::prelude::*;

use crate::error::{Error, InputError, Result};
use crate::model::ModelConfig;
use crate::pipeline::RunOptions;
use crate::pipeline::assembly::shard::ShardRecord;
use crate::pipeline::input::prompts::{self, Corpus};
use crate::pipeline::input::{directions, fingerprint};
use crate::pipeline::output::result::RunResult;
use crate::pipeline::output::resume;
use crate::pipeline::output::store::{S3Config, Store};
use crate::projection::Directions;
use crate::tokenizer::{Encoded, PromptTokenizer};

/// What [`prepare`] found: an output already complete, or a job ready to run.
pub(in crate::pipeline) enum Prepared {
    Finished(RunResult),
    Ready(Box<Ready>),
}

/// Everything a run needs before the model's weights load.
pub(in crate::pipeline) struct Ready {
    pub(in crate::pipeline) plan: ResolvedPlan,
    pub(in crate::pipeline) config: ModelConfig,
    pub(in crate::pipeline) store: Store,
    pub(in crate::pipeline) encoded: Vec<Encoded>,
    pub(in crate::pipeline) directions: Option<Directions>,
    pub(in crate::pipeline) tokenizer: PromptTokenizer,
    pub(in crate::pipeline) fingerprint: String,
    pub(in crate::pipeline) resumed: BTreeMap<usize, ShardRecord>,
}

/// Tokenizes every item of `corpus`: prompts as they are (with the tokenizer's special tokens
/// where `add_special_tokens`), conversations rendered by the model's chat template, which
/// writes their special tokens itself (`add_special_tokens: false` is refused for them, since
/// it would not mean what it means for prompts).
fn encode_corpus(
    corpus: &Corpus,
    tokenizer: &PromptTokenizer,
    add_special_tokens: bool,
    selects_roles: bool,
) -> Result<Vec<Encoded>> {
    match corpus {
        Corpus::Texts(_) if selects_roles => Err(Error::Input(InputError::Chat {
            reason: "roles keeps the tokens of some roles of a conversation, and this job's prompts are plain text: send conversations ({\"messages\": [...]} lines), or leave roles out".into(),
        })),
        Corpus::Texts(texts) => texts
            .par_iter()
            .enumerate()
            .map(|(i, text)| tokenizer.encode(i, text, add_special_tokens))
            .collect(),
        Corpus::Conversations(_) if !add_special_tokens => Err(Error::Input(InputError::Chat {
            reason: "add_special_tokens: false applies to prompts; a conversation's special tokens are its chat template's, with one BOS: leave add_special_tokens out for conversations".into(),
        })),
        Corpus::Conversations(conversations) => conversations
            .par_iter()
            .enumerate()
            .map(|(i, conversation)| tokenizer.encode_conversation(i, conversation))
            .collect(),
    }
}

/// Reads the inputs, resolves the plan against the model, tokenizes the corpus and finds what
/// an earlier run of the same plan left. Bad input fails here, before any output is written.
pub(in crate::pipeline) fn prepare(
    plan: &HarvestPlan,
    options: &RunOptions,
    runtime: &tokio::runtime::Runtime,
) -> Result<Prepared> {
    let store = Store::open(&plan.output, &options.s3)?;
    let (prompt_name, prompt_bytes) =
        runtime.block_on(read_object(&plan.prompts, "prompts", &options.s3))?;
    let corpus = prompts::parse_corpus(&prompt_name, &prompt_bytes)?;
    let config = ModelConfig::from_file(&plan.model.join("config.json"))?;
    let plan = plan.clone().resolve(&config.shape())?;
    let model_name = options.model_name.clone().unwrap_or_else(|| {
        let name = plan.model.file_name().unwrap_or(plan.model.as_os_str());
        name.to_string_lossy().into_owned()
    });
    plan.options.check_router(&model_name, &config.shape())?;
    let directions = match &plan.project_onto {
        Some(location) => {
            let (name, bytes) =
                runtime.block_on(read_object(location, "directions", &options.s3))?;
            Some(directions::load_directions(
                &name,
                &bytes,
                config.hidden_size,
            )?)
        }
        None => None,
    };
    let max_tokens = plan.options.max_tokens(config.max_position_embeddings);
    let tokenizer = PromptTokenizer::from_dir(&plan.model, max_tokens)?;
    let fingerprint = fingerprint::plan_fingerprint(
        &plan,
        &prompt_bytes,
        directions.as_ref(),
        tokenizer.max_tokens(),
    )?;
    if let Some(result) = runtime.block_on(resume::finished_result(&store, &fingerprint))? {
        tracing::info!(output = %plan.output, "harvest already complete; nothing to do");
        return Ok(Prepared::Finished(result));
    }
    let encoded = encode_corpus(
        &corpus,
        &tokenizer,
        plan.options.add_special_tokens,
        plan.options.selection.roles.is_some(),
    )?;
    drop(corpus);
    check_token_budget(&encoded, options.token_budget)?;
    let truncated = encoded
        .iter()
        .filter(|e| e.truncated_from.is_some())
        .count();
    if truncated > 0 {
        tracing::warn!(
            prompts = truncated,
            max_tokens = tokenizer.max_tokens(),
            "prompts longer than max_tokens (the context window, or max_prompt_tokens) were cut; the manifest lists them"
        );
    }
    let n_shards = shard_count(encoded.len(), plan.options.shard_size);
    let resumed = runtime.block_on(resume::resume_scan(&store, &fingerprint, n_shards))?;
    if !resumed.is_empty() {
        tracing::info!(
            shards = resumed.len(),
            of = n_shards,
            "resuming: skipping verified shards"
        );
    }
    Ok(Prepared::Ready(Box::new(Ready {
        plan,
        config,
        store,
        encoded,
        directions,
        tokenizer,
        fingerprint,
        resumed,
    })))
}

/// Refuses a corpus with more tokens than `budget`.
fn check_token_budget(encoded: &[Encoded], budget: Option<u64>) -> Result<()> {
    let Some(budget) = budget else {
        return Ok(());
    };
    let needed: u64 = encoded.iter().map(|e| e.ids.len() as u64).sum();
    if needed > budget {
        return Err(Error::Input(InputError::TokenBudget { needed, budget }));
    }
    Ok(())
}

/// Reads an input object; one that is absent is the job's mistake ([`InputError::MissingInput`](crate::InputError::MissingInput)),
/// a store that fails is not.
async fn read_object(
    location: &harvest_core::Location,
    what: &'static str,
    s3: &S3Config,
) -> Result<(String, Vec<u8>)> {
    let (store, name) = Store::open_object(location, s3)?;
    let bytes = store.get(&name).await?.ok_or_else(|| {
        Error::Input(InputError::MissingInput {
            what,
            location: location.to_string(),
        })
    })?;
    Ok((name, bytes.to_vec()))
}
