//! `-s <prompt>`: one chat turn through the same validation and pipeline as the server,
//! printed to stdout (reasoning to stderr), or as the OpenAI JSON with `--json`.

use std::io::Write;
use std::sync::Arc;

use afm_api::{validate_chat, ChatCompletionRequest};
use afm_server::chat::{collect_chat, start_chat, ChatAccumulator};
use afm_server::generation::ChoiceEvent;
use afm_server::AppState;
use anyhow::Result;
use futures::StreamExt;
use serde_json::json;

use crate::cli::ServeArgs;

pub async fn run(args: &ServeArgs, state: Arc<AppState>, prompt: &str) -> Result<()> {
    let mut messages = Vec::new();
    if let Some(system) = &args.instructions {
        messages.push(json!({"role": "system", "content": system}));
    }
    messages.push(json!({"role": "user", "content": prompt}));
    let body = json!({"messages": messages}).to_string();
    let req = ChatCompletionRequest::parse(body.as_bytes())?;
    let valid = validate_chat(req, &state.config.defaults, &state.model.info)?;
    let mut job = start_chat(&state, valid)?;
    if args.json {
        let response = collect_chat(job).await?;
        println!("{}", serde_json::to_string_pretty(&response)?);
        return Ok(());
    }
    let live = !args.no_streaming;
    let mut acc = ChatAccumulator::new(&job);
    let mut stdout = std::io::stdout();
    while let Some(event) = job.generation.next().await {
        if let (
            true,
            ChoiceEvent::Delta {
                reasoning, content, ..
            },
        ) = (live, &event)
        {
            if let Some(r) = reasoning {
                eprint!("{r}");
            }
            print!("{content}");
            stdout.flush()?;
        }
        acc.push(event)?;
    }
    let response = acc.finish(&job.id, job.created, &job.model);
    if !live {
        let message = &response.choices[0].message;
        if let Some(r) = &message.reasoning_content {
            eprintln!("{r}");
        }
        print!("{}", message.content.as_deref().unwrap_or_default());
    }
    println!();
    Ok(())
}
