//! Counting a corpus's tokens with the model's real tokenizer, in chunks so that the work
//! stops soon after the submit's timeout fires (or once the corpus is known to be over the
//! cap), and memory stays bounded by one chunk's encodings whatever the corpus size.

use std::sync::atomic::{AtomicBool, Ordering};

use harvest_core::chat::{Span, conversation_tokens};
use harvest_core::selection::{Dropped, TokenSelection};

/// Prompts tokenized per call: small enough that a cancelled count stops within a fraction of
/// a second, large enough that the tokenizer's own threads stay busy.
pub const COUNT_CHUNK: usize = 256;

/// Every prompt's tokens, as the worker will run them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Counts {
    /// Tokens of each prompt, cut to the context window.
    pub per_prompt: Vec<usize>,
    /// Prompts that were cut: (prompt, tokens before the cut).
    pub truncated: Vec<(usize, usize)>,
    /// With a token selection: tokens each prompt keeps by its pure filters (the norm filter,
    /// which needs the activations, can only keep fewer).
    pub kept: Option<Vec<usize>>,
    /// With a token selection: what its pure filters drop.
    pub dropped: Dropped,
}

impl Counts {
    /// Tokens in all.
    pub fn total(&self) -> u64 {
        self.per_prompt.iter().map(|&n| n as u64).sum()
    }
}

/// What a count found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Counted {
    /// Every prompt was counted.
    Total(Counts),
    /// Prompt `index` has no tokens at all.
    Empty {
        /// The prompt.
        index: usize,
    },
    /// The count passed `cap` and stopped: at least `at_least` tokens.
    OverCap {
        /// Tokens counted when it stopped.
        at_least: u64,
    },
    /// The caller gave up (its timeout fired) and the count stopped.
    Cancelled,
}

/// What a count is asked to do besides counting.
#[derive(Debug, Clone, Copy)]
pub struct CountOptions<'a> {
    /// Whether the tokenizer adds its special tokens.
    pub add_special_tokens: bool,
    /// For conversations: the BOS id, and whether the tokenizer puts one before plain text;
    /// each is left one BOS (`harvest_core::chat::bos_once`).
    pub bos_once: Option<(u32, bool)>,
    /// The context window each prompt is cut to.
    pub max_tokens: u64,
    /// Stop once the corpus is known to hold more tokens than this.
    pub cap: u64,
    /// Count what this selection keeps of each prompt too.
    pub selection: Option<&'a TokenSelection>,
    /// For conversations: each one's spans (`harvest_core::chat::ChatTemplate::spans`), from
    /// which a selection by `roles` finds each token's role.
    pub spans: Option<&'a [Vec<Span>]>,
}

/// Counts `prompts`, each cut to `max_tokens` as the worker will, stopping at `cap` or when
/// `cancelled` is set.
pub fn count(
    tokenizer: &tokenizers::Tokenizer,
    prompts: &[String],
    options: CountOptions<'_>,
    cancelled: &AtomicBool,
) -> Result<Counted, tokenizers::Error> {
    let CountOptions {
        add_special_tokens,
        bos_once,
        max_tokens,
        cap,
        selection,
        spans,
    } = options;
    // Roles need each token's byte offsets (`encode_batch`), which cost a little more.
    let spans = spans.filter(|_| selection.is_some_and(|s| s.roles.is_some()));
    let special: std::collections::HashSet<u32> = tokenizer
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, token)| token.special)
        .map(|(id, _)| id)
        .collect();
    let mut total = 0u64;
    let mut counts = Counts {
        per_prompt: Vec::with_capacity(prompts.len()),
        kept: selection.map(|_| Vec::with_capacity(prompts.len())),
        ..Counts::default()
    };
    for (chunk_index, chunk) in prompts.chunks(COUNT_CHUNK).enumerate() {
        if cancelled.load(Ordering::Relaxed) {
            return Ok(Counted::Cancelled);
        }
        let inputs: Vec<&str> = chunk.iter().map(String::as_str).collect();
        let encodings = match spans {
            Some(_) => tokenizer.encode_batch(inputs, add_special_tokens)?,
            None => tokenizer.encode_batch_fast(inputs, add_special_tokens)?,
        };
        for (offset, encoding) in encodings.iter().enumerate() {
            let index = chunk_index * COUNT_CHUNK + offset;
            let mut ids = std::borrow::Cow::Borrowed(encoding.get_ids());
            let mut roles = None;
            if let Some(spans) = spans.and_then(|all| all.get(index)) {
                let (bos, adds_bos) = bos_once.map_or((None, false), |(b, a)| (Some(b), a));
                let (fixed, token_roles) = conversation_tokens(
                    ids.into_owned(),
                    encoding.get_offsets(),
                    spans,
                    (bos, adds_bos),
                );
                ids = std::borrow::Cow::Owned(fixed);
                roles = Some(token_roles.roles);
            } else if let Some((bos, adds_bos)) = bos_once {
                let _ = harvest_core::chat::bos_once(ids.to_mut(), Some(bos), adds_bos);
            }
            let n = (ids.len() as u64).min(max_tokens);
            if n == 0 {
                return Ok(Counted::Empty { index });
            }
            if (ids.len() as u64) > max_tokens {
                counts.truncated.push((index, ids.len()));
            }
            counts.per_prompt.push(n as usize);
            if let (Some(rules), Some(kept)) = (selection, counts.kept.as_mut()) {
                let ids = &ids[..n as usize];
                let roles = roles.as_deref().map(|r| &r[..n as usize]);
                let (n_kept, dropped) =
                    rules.count(index, ids.iter().map(|id| special.contains(id)), roles);
                kept.push(n_kept);
                counts.dropped.add(&dropped);
            }
            total += n;
        }
        if total > cap {
            return Ok(Counted::OverCap { at_least: total });
        }
    }
    Ok(Counted::Total(counts))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokenizer() -> tokenizers::Tokenizer {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../harvester/tests/fixtures/tiny-qwen2-f32/tokenizer.json");
        tokenizers::Tokenizer::from_file(path).unwrap()
    }

    fn options(max_tokens: u64, cap: u64) -> CountOptions<'static> {
        CountOptions {
            add_special_tokens: true,
            bos_once: None,
            max_tokens,
            cap,
            selection: None,
            spans: None,
        }
    }

    fn prompts(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("prompt {i} of the corpus"))
            .collect()
    }

    #[test]
    fn a_corpus_is_counted_across_chunks_with_each_prompt_cut_to_the_context() {
        let tokenizer = tokenizer();
        let corpus = prompts(2 * COUNT_CHUNK + 3);
        let one_by_one: u64 = corpus
            .iter()
            .map(|p| tokenizer.encode(p.as_str(), true).unwrap().len() as u64)
            .sum();
        let never = AtomicBool::new(false);
        let Counted::Total(counted) =
            count(&tokenizer, &corpus, options(1_000, u64::MAX), &never).unwrap()
        else {
            panic!("not counted")
        };
        assert_eq!(counted.total(), one_by_one);
        assert_eq!(counted.per_prompt.len(), corpus.len());
        assert!(counted.truncated.is_empty());
        let Counted::Total(cut) = count(&tokenizer, &corpus, options(2, u64::MAX), &never).unwrap()
        else {
            panic!("not counted")
        };
        assert_eq!(cut.total(), 2 * corpus.len() as u64);
        assert_eq!(
            cut.truncated.len(),
            corpus.len(),
            "every prompt is longer than 2"
        );
        assert_eq!(cut.truncated[3].1, counted.per_prompt[3]);
    }

    #[test]
    fn a_cancelled_count_stops_and_an_over_cap_one_stops_early() {
        let tokenizer = tokenizer();
        let corpus = prompts(4 * COUNT_CHUNK);
        let cancelled = AtomicBool::new(true);
        assert_eq!(
            count(&tokenizer, &corpus, options(1_000, u64::MAX), &cancelled).unwrap(),
            Counted::Cancelled
        );
        let never = AtomicBool::new(false);
        let Counted::OverCap { at_least } =
            count(&tokenizer, &corpus, options(1_000, 10), &never).unwrap()
        else {
            panic!("the cap did not stop the count")
        };
        assert!(at_least > 10);
    }

    #[test]
    fn an_empty_prompt_is_named_by_its_index_in_the_whole_corpus() {
        let tokenizer = tokenizer();
        let mut corpus = prompts(COUNT_CHUNK + 5);
        corpus[COUNT_CHUNK + 2] = String::new();
        let never = AtomicBool::new(false);
        assert_eq!(
            count(
                &tokenizer,
                &corpus,
                CountOptions {
                    add_special_tokens: false,
                    ..options(1_000, u64::MAX)
                },
                &never
            )
            .unwrap(),
            Counted::Empty {
                index: COUNT_CHUNK + 2
            }
        );
    }
}
