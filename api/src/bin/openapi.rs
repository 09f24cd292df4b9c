//! Prints the OpenAPI document (committed as api/openapi.json, checked by CI).

use std::io::Write;

fn main() -> std::io::Result<()> {
    std::io::stdout().write_all(harvest_api::openapi::document().as_bytes())
}
