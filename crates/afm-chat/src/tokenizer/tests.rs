//! Unit tests on a tiny hand-made vocabulary.
use super::*;

fn bpe_tok() -> Tokenizer {
    // Byte-level chars: 'Ġ' is a space. Tokens: h e l o Ġ w r d he ll hell hello Ġw <|x|>
    let tokens = [
        "h", "e", "l", "o", "Ġ", "w", "r", "d", "he", "ll", "hell", "hello", "Ġw", "<|x|>", "<u>",
    ];
    let mut spec = VocabSpec::new(
        VocabModel::Bpe,
        tokens.iter().map(|s| s.to_string()).collect(),
    );
    spec.merges = ["h e", "l l", "he ll", "hell o", "Ġ w"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    spec.token_types = vec![1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 3, 4];
    spec.pre = "gpt-2".into();
    spec.eos = Some(13);
    Tokenizer::from_spec(spec).expect("valid spec")
}

#[test]
fn bpe_merges_and_special_split() {
    let t = bpe_tok();
    assert_eq!(
        t.encode("hello world", false, false),
        vec![11, 12, 3, 6, 2, 7]
    );
    // "<|x|>" is a control token: split out only with parse_special.
    assert_eq!(t.encode("hello<|x|>", false, true), vec![11, 13]);
    assert!(!t.encode("hello<|x|>", false, false).contains(&13));
    // "<u>" is user-defined: always split out.
    assert_eq!(t.encode("<u>hello", false, false), vec![14, 11]);
    assert_eq!(t.decode(&[11, 13], false), "hello<|x|>");
    assert_eq!(t.decode(&[11, 13], true), "hello");
    assert_eq!(t.eos_ids(), [13]);
    assert!(t.is_special(13) && !t.is_special(14));
}

#[test]
fn clean_spaces_matches_llamacpp_rules() {
    assert_eq!(
        clean_spaces(b"a , b . I 'm it 's x ' y"),
        b"a, b. I'm it's x'y".to_vec()
    );
}
