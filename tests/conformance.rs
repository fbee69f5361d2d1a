//! The conformance runner's checks on the golden files shipped in tests/golden, on every CPU
//! backend of this build.

#[path = "../examples/conformance/checks.rs"]
mod checks;

use std::path::Path;

use burn::prelude::*;

fn assert_conforms(device: &Device) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let results = checks::run_dir(&dir, device).expect("golden files load");
    let files: Vec<&str> = results.iter().map(|(file, _)| file.as_str()).collect();
    let known: Vec<&str> = checks::KNOWN_FILES.iter().map(|(file, _)| *file).collect();
    assert_eq!(
        files, known,
        "every known golden file is shipped and checked"
    );
    for (file, checks) in results {
        assert!(!checks.is_empty(), "{file}: no checks");
        let failures: Vec<String> = checks
            .iter()
            .filter(|c| !c.passed())
            .map(ToString::to_string)
            .collect();
        assert!(failures.is_empty(), "{file}:\n{}", failures.join("\n"));
    }
}

#[test]
fn golden_vectors_on_flex() {
    assert_conforms(&Device::flex());
}

#[test]
#[allow(deprecated)]
fn golden_vectors_on_ndarray() {
    assert_conforms(&Device::ndarray());
}

#[test]
fn missing_directory_is_an_error() {
    assert!(checks::run_dir(Path::new("/nonexistent"), &Device::flex()).is_err());
}
