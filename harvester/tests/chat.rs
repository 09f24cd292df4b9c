//! Conversations rendered by the model's own chat template give exactly the token ids of
//! transformers' `apply_chat_template(messages, tokenize=True, add_generation_prompt=...)`, for
//! SmolLM2's shipped template and for Llama 3, Qwen2 and Mistral templates on the test
//! tokenizers (`harvester/tests/fixtures/chat/`, written by
//! `scripts/reference/make_chat_fixtures.py`), with one BOS; a template's refusal and a model
//! without a template are named; and `harvester run` harvests a conversations file.
#![allow(clippy::unwrap_used)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use harvest_core::chat::{Conversation, Message};
use harvester::tokenizer::PromptTokenizer;

fn fixtures() -> PathBuf {
    common::fixtures().join("chat")
}

fn reference() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("reference.json")).unwrap())
        .unwrap()
}

/// The family's tokenizer directory: the fixture's, or SmolLM2's imported checkpoint.
fn family_dir(family: &serde_json::Value) -> PathBuf {
    match family["dir"].as_str() {
        Some(dir) => fixtures().join(dir),
        None => common::smollm2_dir(),
    }
}

fn conversation(reference: &serde_json::Value, case: &serde_json::Value) -> Conversation {
    let index = case["conversation"].as_u64().unwrap() as usize;
    let messages: Vec<Message> =
        serde_json::from_value(reference["conversations"][index].clone()).unwrap();
    Conversation {
        messages,
        add_generation_prompt: case["add_generation_prompt"].as_bool().unwrap(),
    }
}

#[test]
fn every_conversation_tokenizes_to_transformers_apply_chat_template_ids_in_each_family() {
    let reference = reference();
    let families = reference["families"].as_object().unwrap();
    assert_eq!(families.len(), 4, "smollm2, llama3, qwen2, mistral");
    for (name, family) in families {
        let tokenizer = PromptTokenizer::from_dir(&family_dir(family), 1 << 20).unwrap();
        assert!(tokenizer.has_chat_template(), "{name}");
        let cases = family["cases"].as_array().unwrap();
        assert!(!cases.is_empty(), "{name}");
        for case in cases {
            let expected: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
            let index = case["conversation"].as_u64().unwrap() as usize;
            let ours = tokenizer
                .encode_conversation(index, &conversation(&reference, case))
                .unwrap();
            assert_eq!(ours.ids, expected, "{name}: {case}");
            let roles = ours.roles.expect("a conversation's tokens have roles");
            let expected_roles: Vec<u8> = serde_json::from_value(case["roles"].clone()).unwrap();
            let expected_turns: Vec<u16> = serde_json::from_value(case["turns"].clone()).unwrap();
            assert_eq!(roles.roles, expected_roles, "{name}: roles of {case}");
            assert_eq!(roles.turns, expected_turns, "{name}: turns of {case}");
            // One BOS where the model has one, whatever the template wrote.
            if let Some(bos) = tokenizer.bos_id() {
                let leading = ours.ids.iter().take_while(|&&id| id == bos).count();
                assert!(leading <= 1, "{name}: {leading} BOS");
            }
        }
        for refused in family["refused"].as_array().unwrap() {
            let index = refused["conversation"].as_u64().unwrap() as usize;
            let error = tokenizer
                .encode_conversation(index, &conversation(&reference, refused))
                .unwrap_err()
                .to_string();
            let words = refused["error"].as_str().unwrap();
            assert!(
                error.contains(&format!("conversation {index}")) && error.contains(words),
                "{name}: {error}"
            );
        }
    }
}

#[test]
fn a_model_without_a_chat_template_refuses_a_conversation_naming_its_tokenizer_config() {
    let dir = common::fixtures().join("tiny-llama3-f16-sharded");
    let tokenizer = PromptTokenizer::from_dir(&dir, 1 << 20).unwrap();
    assert!(!tokenizer.has_chat_template());
    let conversation: Conversation =
        serde_json::from_str(r#"{"messages": [{"role": "user", "content": "hi"}]}"#).unwrap();
    let error = tokenizer
        .encode_conversation(0, &conversation)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("no chat template")
            && error.contains("tokenizer_config.json")
            && error.contains("send prompts"),
        "{error}"
    );
}

fn harvester() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_harvester"));
    command.env("RUST_LOG", "warn");
    command
}

fn run(prompts: &Path, out: &Path, extra: &[&str]) -> std::process::Output {
    harvester()
        .args([
            "run",
            "--device",
            "cpu",
            "--layers",
            "3",
            "--progress",
            "off",
            "--model",
        ])
        .arg(common::smollm2_dir())
        .arg("--prompts")
        .arg(prompts)
        .arg("--out")
        .arg(out)
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn a_conversations_file_is_harvested_with_the_template_s_token_ids() {
    let reference = reference();
    let family = &reference["families"]["smollm2"];
    let dir = tempfile::tempdir().unwrap();
    let cases = family["cases"].as_array().unwrap();
    let lines: Vec<String> = cases
        .iter()
        .map(|case| serde_json::to_string(&conversation(&reference, case)).unwrap())
        .collect();
    let prompts = dir.path().join("chats.jsonl");
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let out = dir.path().join("out");
    let output = run(&prompts, &out, &[]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let manifest: harvest_core::format::Manifest =
        serde_json::from_str(&std::fs::read_to_string(out.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest.n_prompts, cases.len());
    let mut index = 0;
    for shard in &manifest.shards {
        let bytes = std::fs::read(out.join(&shard.file)).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for &prompt in &shard.prompts {
            let tokens = tensors.tensor(&format!("tokens_{prompt}")).unwrap();
            let ids: Vec<u32> = tokens
                .data()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            let expected: Vec<u32> = serde_json::from_value(cases[index]["ids"].clone()).unwrap();
            assert_eq!(ids, expected, "conversation {prompt}");
            index += 1;
        }
    }
    assert_eq!(index, cases.len());
    let ids_of = |tensors: &safetensors::SafeTensors<'_>, name: &str| -> Vec<u32> {
        let tensor = tensors.tensor(name).unwrap();
        match tensor.dtype() {
            safetensors::Dtype::U8 => tensor.data().iter().map(|&b| u32::from(b)).collect(),
            safetensors::Dtype::U16 => tensor
                .data()
                .chunks_exact(2)
                .map(|b| u32::from(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
            _ => tensor
                .data()
                .chunks_exact(4)
                .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        }
    };
    let roles = manifest
        .roles
        .as_ref()
        .expect("the manifest documents roles");
    assert_eq!(roles.ids["3"], "assistant");
    // An assistant-only job keeps exactly the assistant's tokens: the full run's rows there.
    let assistant = dir.path().join("assistant");
    let output = run(&prompts, &assistant, &["--roles", "assistant"]);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let kept: harvest_core::format::Manifest =
        serde_json::from_str(&std::fs::read_to_string(assistant.join("manifest.json")).unwrap())
            .unwrap();
    let mut kept_total = 0;
    for (full_shard, shard) in manifest.shards.iter().zip(&kept.shards) {
        let full_bytes = std::fs::read(out.join(&full_shard.file)).unwrap();
        let full = safetensors::SafeTensors::deserialize(&full_bytes).unwrap();
        let bytes = std::fs::read(assistant.join(&shard.file)).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for &prompt in &shard.prompts {
            let case = &cases[prompt];
            let expected_roles: Vec<u32> = serde_json::from_value(case["roles"].clone()).unwrap();
            let expected: Vec<u32> = (0..expected_roles.len() as u32)
                .filter(|&p| expected_roles[p as usize] == 3)
                .collect();
            assert_eq!(ids_of(&tensors, &format!("roles_{prompt}")), expected_roles);
            assert_eq!(
                ids_of(&tensors, &format!("turns_{prompt}")),
                serde_json::from_value::<Vec<u32>>(case["turns"].clone()).unwrap()
            );
            let positions = ids_of(&tensors, &format!("positions_{prompt}"));
            assert_eq!(positions, expected, "conversation {prompt}");
            let rows = tensors.tensor(&format!("prompt_{prompt}")).unwrap();
            let all = full.tensor(&format!("prompt_{prompt}")).unwrap();
            let width = 2 * rows.shape()[2];
            for (row, &position) in positions.iter().enumerate() {
                assert_eq!(
                    rows.data()[row * width..][..width],
                    all.data()[position as usize * width..][..width],
                    "conversation {prompt} row {row}"
                );
            }
            kept_total += positions.len() as u64;
        }
    }
    let selection = kept.selection.as_ref().unwrap();
    assert_eq!(selection.kept_tokens, kept_total);
    assert!(
        kept_total > 0 && selection.dropped.roles > 0,
        "{selection:?}"
    );
    assert_eq!(
        kept.stats_tokens, kept_total,
        "statistics describe the kept rows only"
    );
    // The shuffled layout: each training row carries its token's role, and the files are the
    // size the estimate predicts.
    let shuffled = dir.path().join("shuffled");
    let output = run(
        &prompts,
        &shuffled,
        &["--layout", "shuffled", "--rows-per-file", "50"],
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let written: harvest_core::format::Manifest =
        serde_json::from_str(&std::fs::read_to_string(shuffled.join("manifest.json")).unwrap())
            .unwrap();
    let train = written.train.as_ref().unwrap();
    assert_eq!(train.tensors.last().map(String::as_str), Some("roles"));
    let mut rows = 0;
    for file in &train.files {
        let bytes = std::fs::read(shuffled.join(&file.file)).unwrap();
        let tensors = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let index = ids_of(&tensors, "index");
        let row_roles = ids_of(&tensors, "roles");
        assert_eq!(index.len(), 2 * row_roles.len());
        for (pair, &role) in index.chunks(2).zip(&row_roles) {
            let expected: Vec<u32> =
                serde_json::from_value(cases[pair[0] as usize]["roles"].clone()).unwrap();
            assert_eq!(
                role, expected[pair[1] as usize],
                "prompt {} position {}",
                pair[0], pair[1]
            );
        }
        rows += row_roles.len();
    }
    assert_eq!(rows as u64, written.total_tokens);
    let counts: Vec<usize> = manifest
        .shards
        .iter()
        .flat_map(|s| s.token_counts.clone())
        .collect();
    let sites = harvest_core::Sites::default();
    let predicted = harvest_core::estimate::predict(&harvest_core::estimate::JobShape {
        token_counts: &counts,
        truncated: &[],
        shard_size: written.shard_size,
        layers: &written.layer_indices,
        sites: &sites,
        layout: harvest_core::layout::Layout::Shuffled {
            rows_per_file: std::num::NonZeroUsize::new(50).unwrap(),
            seed: 0,
        },
        precision: written.precision,
        selection: None,
        contents: written.contents,
        width: written.model.hidden_size,
        model: written.model.clone(),
        add_special_tokens: true,
        bos_token_id: written.tokenizer.bos_token_id,
        max_tokens: written.tokenizer.max_tokens,
        conversations: true,
        router: None,
    });
    let sizes: Vec<u64> = train.files.iter().map(|f| f.bytes).collect();
    assert_eq!(predicted.shards, sizes, "training files to the byte");
    // roles on plain prompts is refused by name.
    let plain = dir.path().join("plain.jsonl");
    std::fs::write(&plain, "{\"text\": \"hello\"}\n").unwrap();
    let refused = run(&plain, &dir.path().join("plain"), &["--roles", "assistant"]);
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("roles") && stderr.contains("plain text"),
        "{stderr}"
    );
    // add_special_tokens: false means nothing for a conversation, and is refused by name.
    let refused = run(
        &prompts,
        &dir.path().join("refused"),
        &["--no-special-tokens"],
    );
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert_eq!(refused.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("add_special_tokens: false applies to prompts"),
        "{stderr}"
    );
}
