//! Prints the CRD YAML committed under `manifests/crds/`; CI diffs the two.
#![allow(clippy::print_stdout)]

fn main() -> anyhow::Result<()> {
    for crd in harvest_crds::all_crds() {
        print!("---\n{}", serde_yaml::to_string(&crd)?);
    }
    Ok(())
}
