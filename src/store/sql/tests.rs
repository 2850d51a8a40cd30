//! Unit tests of the SQL store's pure parts.
use super::schema::split_statements;
use super::*;

#[test]
fn numbers_placeholders() {
    assert_eq!(number_params("a = ? AND b = ?"), "a = $1 AND b = $2");
}

#[test]
fn splits_scripts() {
    let s = "-- head; comment\nCREATE TABLE a (x INT); -- tail\n\nCREATE INDEX i ON a (x);\n";
    assert_eq!(
        split_statements(s),
        ["CREATE TABLE a (x INT)", "CREATE INDEX i ON a (x)"]
    );
}
