//! The table from format to openers (the markers that switch text into a call) and from
//! opener to the body that parses what follows. Adding a dialect is a row here plus its body.

use super::gemma::Gemma;
use super::json_calls::{Block, JsonCalls, Mistral, HERMES_FENCE_LIST, LLAMA_LIST};
use super::scan::partial_suffix_len;
use super::token_calls::{TokenCalls, DEEPSEEK, KIMI};
use super::xml_calls::{Glm, Xml, DSML, MINIMAX, QWEN};
use super::{Body, ToolCallFormat};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// `<tool_call>` holding JSON or a Qwen `<function=`.
    ToolCallBlock,
    /// A ```json Markdown fence holding a Hermes-style call object.
    JsonFence,
    QwenBare,
    LlamaTag,
    /// Llama's bare `{` (only as the first thing in the output).
    LlamaBrace,
    Mistral,
    GemmaTag,
    FunctionGemma,
    GemmaCode,
    Glm,
    KimiSection,
    KimiCall,
    MinimaxSection,
    MinimaxBare,
    DeepSeekSection,
    DeepSeekCall,
    DsmlSection,
    DsmlBare,
}

#[derive(Debug)]
pub(crate) struct Opener {
    pub text: &'static str,
    pub kind: Kind,
    /// Valid only before any non-whitespace text.
    pub at_start: bool,
}

const fn op(text: &'static str, kind: Kind) -> Opener {
    Opener {
        text,
        kind,
        at_start: false,
    }
}

const HERMES: &[Opener] = &[
    op("<tool_call>", Kind::ToolCallBlock),
    op("```json", Kind::JsonFence),
];
const QWEN_XML: &[Opener] = &[
    op("<tool_call>", Kind::ToolCallBlock),
    op("<function=", Kind::QwenBare),
];
const LLAMA: &[Opener] = &[
    op("<|python_tag|>", Kind::LlamaTag),
    Opener {
        text: "{",
        kind: Kind::LlamaBrace,
        at_start: true,
    },
];
const MISTRAL: &[Opener] = &[op("[TOOL_CALLS]", Kind::Mistral)];
const GEMMA: &[Opener] = &[
    op("<|tool_call>", Kind::GemmaTag),
    op("<start_function_call>", Kind::FunctionGemma),
    op("```tool_code", Kind::GemmaCode),
];
const GLM: &[Opener] = &[op("<tool_call>", Kind::Glm)];
const KIMI_K2: &[Opener] = &[
    op("<|tool_calls_section_begin|>", Kind::KimiSection),
    op("<|tool_call_section_begin|>", Kind::KimiSection),
    op("<|tool_call_begin|>", Kind::KimiCall),
];
const MINIMAX_M2: &[Opener] = &[
    op("<minimax:tool_call>", Kind::MinimaxSection),
    op("<invoke name=", Kind::MinimaxBare),
];
const DEEPSEEK_V3: &[Opener] = &[
    op("<｜tool▁calls▁begin｜>", Kind::DeepSeekSection),
    op("<｜tool▁call▁begin｜>", Kind::DeepSeekCall),
];
const DEEPSEEK_DSML: &[Opener] = &[
    op("<｜DSML｜tool_calls>", Kind::DsmlSection),
    op("<｜DSML｜function_calls>", Kind::DsmlSection),
    op("<｜DSML｜invoke name=", Kind::DsmlBare),
];

fn openers(format: ToolCallFormat) -> &'static [Opener] {
    match format {
        ToolCallFormat::Hermes => HERMES,
        ToolCallFormat::Llama3Json => LLAMA,
        ToolCallFormat::Mistral => MISTRAL,
        ToolCallFormat::QwenXml => QWEN_XML,
        ToolCallFormat::Gemma => GEMMA,
        ToolCallFormat::Glm4 => GLM,
        ToolCallFormat::KimiK2 => KIMI_K2,
        ToolCallFormat::MinimaxM2 => MINIMAX_M2,
        ToolCallFormat::DeepSeekV3 => DEEPSEEK_V3,
        ToolCallFormat::DeepSeekV4Dsml => DEEPSEEK_DSML,
        ToolCallFormat::None => &[],
    }
}

/// The earliest opener in `text` and where it starts. `at_start`: nothing but whitespace has
/// been emitted so far in this turn.
pub(crate) fn find_opener(
    format: ToolCallFormat,
    text: &str,
    at_start: bool,
) -> Option<(usize, &'static Opener)> {
    let lead = text.len() - text.trim_start().len();
    openers(format)
        .iter()
        .filter_map(|o| match o.at_start {
            true => (at_start && text[lead..].starts_with(o.text)).then_some((lead, o)),
            false => text.find(o.text).map(|at| (at, o)),
        })
        .min_by_key(|(at, o)| (*at, usize::MAX - o.text.len()))
}

/// How much of the end of `text` may be the start of an opener.
pub(crate) fn partial_opener_len(format: ToolCallFormat, text: &str, at_start: bool) -> usize {
    let marks: Vec<&str> = openers(format)
        .iter()
        .filter(|o| !o.at_start || at_start)
        .map(|o| o.text)
        .collect();
    partial_suffix_len(text, &marks)
}

pub(crate) fn open_body(opener: &Opener) -> Box<dyn Body> {
    match opener.kind {
        Kind::ToolCallBlock => Box::new(Block::new()),
        Kind::JsonFence => Box::new(JsonCalls::new(&HERMES_FENCE_LIST)),
        Kind::QwenBare => Box::new(Xml::in_header(&QWEN)),
        Kind::LlamaTag => Box::new(JsonCalls::new(&LLAMA_LIST)),
        Kind::LlamaBrace => Box::new(JsonCalls::in_object(&LLAMA_LIST)),
        Kind::Mistral => Box::new(Mistral::new()),
        Kind::GemmaTag => Box::new(Gemma::new("<tool_call|>")),
        Kind::FunctionGemma => Box::new(Gemma::new("<end_function_call>")),
        Kind::GemmaCode => Box::new(Gemma::code_block()),
        Kind::Glm => Box::new(Glm::new()),
        Kind::KimiSection => Box::new(TokenCalls::new(&KIMI)),
        Kind::KimiCall => Box::new(TokenCalls::in_call(&KIMI)),
        Kind::MinimaxSection => Box::new(Xml::new(&MINIMAX)),
        Kind::MinimaxBare => Box::new(Xml::in_header(&MINIMAX)),
        Kind::DeepSeekSection => Box::new(TokenCalls::new(&DEEPSEEK)),
        Kind::DeepSeekCall => Box::new(TokenCalls::in_call(&DEEPSEEK)),
        Kind::DsmlSection => Box::new(Xml::new(&DSML)),
        Kind::DsmlBare => Box::new(Xml::in_header(&DSML)),
    }
}
