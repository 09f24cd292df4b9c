//! docs/install.md as written: its `sh` blocks, in order, on an empty real-tier cluster
//! (`scripts/cluster.sh up --real` with nothing installed). A block that needs a registry or a
//! cloud carries a comment above it, `<!-- install-test: instead COMMAND — why -->` (the
//! local stand-in runs) or `<!-- install-test: skip — why -->`; every other block runs as a
//! platform team would paste it.
#![allow(clippy::unwrap_used, clippy::panic)]

use harvest_e2e::{Install, LocalCluster, Tier, repo};

/// What the test does with one `sh` block.
#[derive(Debug, PartialEq, Eq)]
enum Run {
    AsWritten,
    Instead { command: String, why: String },
    Skip { why: String },
}

#[derive(Debug)]
struct Block {
    /// Its first line's number in the file, for messages.
    line: usize,
    script: String,
    run: Run,
}

/// The marker comment's meaning, or what is wrong with it.
fn marker(comment: &str) -> Result<Run, String> {
    let body = comment
        .strip_prefix("<!-- install-test: ")
        .and_then(|c| c.strip_suffix(" -->"))
        .ok_or_else(|| format!("not a marker: {comment}"))?;
    let (what, why) = body
        .rsplit_once(" — ")
        .ok_or_else(|| format!("{comment}: say why after \" — \""))?;
    let why = why.trim().to_owned();
    if why.is_empty() {
        return Err(format!("{comment}: the reason is empty"));
    }
    if what == "skip" {
        Ok(Run::Skip { why })
    } else if let Some(command) = what.strip_prefix("instead ") {
        Ok(Run::Instead {
            command: command.to_owned(),
            why,
        })
    } else {
        Err(format!(
            "{comment}: use \"instead COMMAND — why\" or \"skip — why\""
        ))
    }
}

/// The `sh` blocks of `markdown`, each with the marker on the last line above its fence.
fn blocks(markdown: &str) -> Result<Vec<Block>, String> {
    let mut found = Vec::new();
    let mut lines = markdown.lines().enumerate();
    let mut above = "";
    while let Some((number, line)) = lines.next() {
        if line.trim() != "```sh" {
            if line.trim().starts_with("<!-- install-test:") {
                above = line.trim();
            } else if !line.trim().is_empty() {
                above = "";
            }
            continue;
        }
        let run = if above.is_empty() {
            Run::AsWritten
        } else {
            marker(above)?
        };
        above = "";
        let mut script = String::new();
        loop {
            let (_, line) = lines
                .next()
                .ok_or_else(|| format!("line {}: the block never closes", number + 1))?;
            if line.trim() == "```" {
                break;
            }
            script.push_str(line);
            script.push('\n');
        }
        found.push(Block {
            line: number + 1,
            script,
            run,
        });
    }
    Ok(found)
}

fn guide() -> String {
    std::fs::read_to_string(repo().join("docs/install.md")).unwrap()
}

#[test]
fn every_block_of_the_install_guide_runs_as_written_or_is_marked_with_why() {
    let found = blocks(&guide()).unwrap();
    let written = found.iter().filter(|b| b.run == Run::AsWritten).count();
    // Most of the guide runs as written; what stands in for a cloud or a registry is a local
    // script, never an empty step.
    assert!(written >= 6, "{found:#?}");
    for block in &found {
        if let Run::Instead { command, .. } = &block.run {
            assert!(command.contains("scripts/cluster.sh"), "{block:?}");
        }
    }
    // A marker without its reason, or of an unknown kind, is refused by name.
    let error = marker("<!-- install-test: instead kubectl version -->").unwrap_err();
    assert!(error.contains("say why"), "{error}");
    let error = marker("<!-- install-test: maybe — because -->").unwrap_err();
    assert!(error.contains("instead COMMAND"), "{error}");
    let error = blocks("```sh\nkubectl version\n").unwrap_err();
    assert!(error.contains("never closes"), "{error}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docs_install_md_runs_as_written_on_an_empty_real_cluster() {
    let cluster = LocalCluster::up_installing(Tier::Real, Install::Nothing);
    let mut ran_the_example_job = false;
    for block in blocks(&guide()).unwrap() {
        let script = match &block.run {
            Run::AsWritten => block.script.clone(),
            Run::Instead { command, .. } => command.clone(),
            Run::Skip { .. } => continue,
        };
        let out = cluster.shell(&script);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "docs/install.md line {} ({:?}) failed:\n{script}\nstdout:\n{stdout}\nstderr:\n{}",
            block.line,
            block.run,
            String::from_utf8_lossy(&out.stderr)
        );
        // `kubectl wait --for=condition=Finished` passes on a failed job too: the guide's
        // `kubectl get hj` must show it succeeded.
        if script.contains("get hj smollm2-quartiles") {
            assert!(stdout.contains("Succeeded"), "{stdout}");
            ran_the_example_job = true;
        }
    }
    assert!(
        ran_the_example_job,
        "the guide no longer runs the example job"
    );
    // Its last step removes the CRDs on purpose.
    let crds = cluster.field(&["crd"], "{.items[*].metadata.name}");
    assert!(!crds.contains("harvest.dev"), "{crds}");
}
