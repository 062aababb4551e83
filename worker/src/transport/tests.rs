//! Unit tests of the transport.

use super::*;

#[test]
fn error_codes_are_named() {
    assert_eq!(describe(15).0, "count_mismatch");
    assert!(describe(19).1.contains("restarted"));
    assert_eq!(describe(999).0, "unknown error code 999");
}
