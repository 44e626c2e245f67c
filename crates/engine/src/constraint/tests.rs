use super::*;
use crate::tokenizer::test_support::byte_level;

fn compiler() -> (ConstraintCompiler, Arc<Tokenizer>, u32) {
    let tokenizer = Arc::new(byte_level());
    let eos = tokenizer.eos_token_id().expect("the fixture names an eos");
    let vocab = tokenizer.vocab_size() + 5; // padding rows past the vocabulary
    (
        ConstraintCompiler::new(Arc::clone(&tokenizer), vocab, &[eos]),
        tokenizer,
        eos,
    )
}

/// Generates under `c` from pseudo-random logits (greedy on the masked logits) until the
/// grammar completes or an end-of-sequence token is picked; the text made.
fn run(c: &mut Constraint, tokenizer: &Tokenizer, vocab: usize, eos: u32, seed: u64) -> String {
    let mut state = seed;
    let mut ids = Vec::new();
    for _ in 0..400 {
        let mut logits: Vec<f32> = (0..vocab)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect();
        c.apply(&mut logits).unwrap();
        let token = ember_tensor::cpu::argmax(&logits);
        assert!(
            logits[token as usize].is_finite(),
            "a masked token was picked"
        );
        c.accept(token).unwrap();
        if token == eos {
            break;
        }
        ids.push(token);
        if c.is_complete() {
            break;
        }
    }
    tokenizer.decode(&ids, false)
}

#[test]
fn a_grammar_of_one_string_gives_exactly_it() {
    let (compiler, tokenizer, eos) = compiler();
    let vocab = compiler.vocab;
    for grammar in [
        Grammar::Gbnf("root ::= \"The answer is 42.\"\n".into()),
        Grammar::Lark("%llguidance {}\nstart: \"The answer is 42.\"\n".into()),
    ] {
        for seed in 0..3 {
            let mut c = compiler.compile(&grammar).unwrap();
            let text = run(&mut c, &tokenizer, vocab, eos, seed);
            assert_eq!(text, "The answer is 42.", "{grammar:?}");
        }
    }
}

#[test]
fn json_schemas_hold_the_output_to_their_shape() {
    let (compiler, tokenizer, eos) = compiler();
    let vocab = compiler.vocab;
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "kind": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}
        },
        "required": ["name", "kind", "tags"],
        "additionalProperties": false
    });
    for seed in 0..4 {
        let mut c = compiler
            .compile(&Grammar::JsonSchema(schema.clone()))
            .unwrap();
        let text = run(&mut c, &tokenizer, vocab, eos, seed);
        let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        let object = value.as_object().expect("an object");
        assert!(
            ["cat", "dog"].contains(&object["kind"].as_str().unwrap()),
            "{text}"
        );
        assert!(
            object["name"].as_str().unwrap().chars().count() <= 8,
            "{text}"
        );
        assert!(
            object["tags"].as_array().unwrap().iter().all(Value::is_i64),
            "{text}"
        );
        assert_eq!(object.len(), 3, "{text}");
    }
    let mut c = compiler.compile(&Grammar::JsonObject).unwrap();
    let text = run(&mut c, &tokenizer, vocab, eos, 9);
    let value: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
    assert!(value.is_object(), "{text}");
}

#[test]
fn bad_grammars_are_errors_that_say_why() {
    let (compiler, ..) = compiler();
    let e = compiler
        .compile(&Grammar::Gbnf("root ::= undefined-rule\n".into()))
        .unwrap_err();
    assert!(
        matches!(&e, ConstraintError::Grammar(m) if m.contains("undefined-rule")),
        "{e}"
    );
    let e = compiler
        .compile(&Grammar::JsonSchema(
            serde_json::json!({"type": "no-such-type"}),
        ))
        .unwrap_err();
    assert!(matches!(e, ConstraintError::Grammar(_)), "{e}");
    let e = compiler
        .compile(&Grammar::Lark("start: (".into()))
        .unwrap_err();
    assert!(matches!(e, ConstraintError::Grammar(_)), "{e}");
}

#[test]
fn llama_grammars_choose_their_syntax_by_the_marker() {
    assert!(matches!(
        Grammar::from_llama_grammar("%llguidance {}\nstart: \"a\""),
        Grammar::Lark(_)
    ));
    assert!(matches!(
        Grammar::from_llama_grammar("root ::= \"a\""),
        Grammar::Gbnf(_)
    ));
}
