//! Conversations, rendered by the model's own chat template as transformers'
//! `apply_chat_template` renders them: the `chat_template` of `tokenizer_config.json` (or a
//! GGUF's `tokenizer.chat_template`), a Jinja template, rendered here with minijinja set up as
//! transformers sets up Jinja (`trim_blocks`, `lstrip_blocks`, loop controls, Python's string
//! methods, `raise_exception`, and a `tojson` that writes what Python's `json.dumps` writes).
//! `strftime_now` is left undefined on purpose, so templates that date their system prompt fall
//! back to their own fixed date and a harvest stays reproducible.
//!
//! The rendered text is then tokenized without special tokens (the template writes its own),
//! and [`bos_once`] leaves exactly one BOS at the start whatever the template did.

use serde::{Deserialize, Serialize};

/// Who speaks a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// The system prompt.
    System,
    /// The user.
    User,
    /// The model.
    Assistant,
    /// A tool's answer.
    Tool,
}

impl Role {
    /// The role's name, as templates see it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::System => "system",
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::Tool => "tool",
        }
    }
}

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Message {
    /// Who speaks it.
    pub role: Role,
    /// What is said.
    pub content: String,
}

/// A conversation and how it ends.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conversation {
    /// Its messages, in order: at least one.
    pub messages: Vec<Message>,
    /// Whether the template's opening of the assistant's next turn is added at the end.
    #[serde(default)]
    pub add_generation_prompt: bool,
}

/// Why a conversation was not rendered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ChatError {
    /// The template does not parse.
    #[error("the model's chat template does not parse: {reason}")]
    BadTemplate {
        /// The parser's complaint.
        reason: String,
    },
    /// The template refused or failed on this conversation (its `raise_exception`, say).
    #[error("conversation {index}: the chat template failed: {reason}")]
    Render {
        /// The conversation, from 0.
        index: usize,
        /// The template's error.
        reason: String,
    },
    /// A conversation without messages.
    #[error("conversation {index} has no messages: give each at least one")]
    Empty {
        /// The conversation, from 0.
        index: usize,
    },
}

/// The special tokens a template may name (`bos_token`, `eos_token`, ...), as transformers
/// passes them: their text.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SpecialTokens {
    /// `bos_token`.
    pub bos: Option<String>,
    /// `eos_token`.
    pub eos: Option<String>,
    /// `unk_token`.
    pub unk: Option<String>,
    /// `pad_token`.
    pub pad: Option<String>,
}

/// What a `tokenizer_config.json` says of chat: its template (the `chat_template` string, or
/// from a list of named templates the one named `default`, as transformers picks it) and the
/// special tokens a template may name (each a string or an object with a `content`).
pub fn from_tokenizer_config(config: &serde_json::Value) -> (Option<String>, SpecialTokens) {
    let token = |name: &str| match config.get(name)? {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_owned),
        _ => None,
    };
    let template = match config.get("chat_template") {
        Some(serde_json::Value::String(source)) => Some(source.clone()),
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t.get("name").and_then(serde_json::Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str().map(str::to_owned)),
        _ => None,
    };
    let special = SpecialTokens {
        bos: token("bos_token"),
        eos: token("eos_token"),
        unk: token("unk_token"),
        pad: token("pad_token"),
    };
    (template, special)
}

/// A model's chat template, parsed once.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    environment: minijinja::Environment<'static>,
    special: SpecialTokens,
}

/// The template's name in its environment.
const NAME: &str = "chat";

impl ChatTemplate {
    /// Parses `source` with the special tokens it may name; a syntax error is named.
    pub fn new(source: &str, special: SpecialTokens) -> Result<Self, ChatError> {
        let mut environment = minijinja::Environment::new();
        environment.set_trim_blocks(true);
        environment.set_lstrip_blocks(true);
        environment
            .set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        environment.add_function("raise_exception", raise_exception);
        environment.add_filter("tojson", tojson);
        environment
            .add_template_owned(NAME, source.to_owned())
            .map_err(|e| ChatError::BadTemplate {
                reason: e.to_string(),
            })?;
        Ok(Self {
            environment,
            special,
        })
    }

    /// Renders conversation `index` (its number, for errors) as the model reads it.
    pub fn render(&self, index: usize, conversation: &Conversation) -> Result<String, ChatError> {
        if conversation.messages.is_empty() {
            return Err(ChatError::Empty { index });
        }
        self.render_messages(
            index,
            &conversation.messages,
            conversation.add_generation_prompt,
        )
    }

    /// Renders `messages` (possibly a conversation's first few) with or without the generation
    /// prompt.
    pub fn render_messages(
        &self,
        index: usize,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        let fail = |e: minijinja::Error| ChatError::Render {
            index,
            reason: describe(&e),
        };
        let template = self.environment.get_template(NAME).map_err(fail)?;
        let messages: Vec<minijinja::Value> = messages
            .iter()
            .map(|m| {
                minijinja::context! { role => m.role.as_str(), content => m.content.as_str() }
            })
            .collect();
        let special = &self.special;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => special.bos.as_deref(),
                eos_token => special.eos.as_deref(),
                unk_token => special.unk.as_deref(),
                pad_token => special.pad.as_deref(),
            })
            .map_err(fail)
    }
}

/// An error's message with its causes, as the template's author wrote it where they did.
fn describe(error: &minijinja::Error) -> String {
    let mut text = error
        .detail()
        .map_or_else(|| error.to_string(), str::to_owned);
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// `raise_exception(message)`: the template refuses the conversation.
fn raise_exception(message: String) -> Result<minijinja::Value, minijinja::Error> {
    Err(minijinja::Error::new(
        minijinja::ErrorKind::InvalidOperation,
        message,
    ))
}

/// `tojson(value, indent=None)` as transformers defines it: Python's `json.dumps` with
/// `ensure_ascii=False` (`", "` and `": "` between items, or `indent` spaces a level).
fn tojson(
    value: minijinja::Value,
    kwargs: minijinja::value::Kwargs,
) -> Result<minijinja::Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value).map_err(|e| {
        minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, e.to_string())
    })?;
    let mut out = String::new();
    python_dumps(&json, indent, 0, &mut out);
    Ok(minijinja::Value::from_safe_string(out))
}

/// Writes `value` as Python's `json.dumps(value, ensure_ascii=False, indent=indent)` does.
fn python_dumps(value: &serde_json::Value, indent: Option<usize>, depth: usize, out: &mut String) {
    use serde_json::Value;
    let newline = |out: &mut String, depth: usize| {
        if let Some(width) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(width * depth));
        }
    };
    let separator = if indent.is_some() { "," } else { ", " };
    match value {
        Value::Array(items) if !items.is_empty() => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                python_dumps(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Value::Object(fields) if !fields.is_empty() => {
            out.push('{');
            for (i, (key, item)) in fields.iter().enumerate() {
                if i > 0 {
                    out.push_str(separator);
                }
                newline(out, depth + 1);
                out.push_str(&Value::String(key.clone()).to_string());
                out.push_str(": ");
                python_dumps(item, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// Leaves exactly one `bos` at the start of `ids` where the model has one: a doubled BOS (the
/// template wrote one and something added another) loses the extra, and where the tokenizer
/// would add one to plain text (`adds_bos`) but the template wrote none, one is added.
pub fn bos_once(ids: &mut Vec<u32>, bos: Option<u32>, adds_bos: bool) {
    let Some(bos) = bos else {
        return;
    };
    let leading = ids.iter().take_while(|&&id| id == bos).count();
    if leading > 1 {
        ids.drain(..leading - 1);
    } else if leading == 0 && adds_bos {
        ids.insert(0, bos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn said(role: Role, content: &str) -> Message {
        Message {
            role,
            content: content.into(),
        }
    }

    #[test]
    fn a_chatml_conversation_renders_with_its_default_system_prompt_and_generation_prompt() {
        let template = ChatTemplate::new(CHATML, SpecialTokens::default()).unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::User, "Hi"), said(Role::Assistant, "Hello")],
            add_generation_prompt: true,
        };
        assert_eq!(
            template.render(0, &conversation).unwrap(),
            "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn blocks_are_trimmed_as_transformers_trims_them_and_python_methods_work() {
        let source = "{{ bos_token }}{% for m in messages %}\n  {{ m['content'] | trim }}|{{ m.content.strip().upper() }}\n{% endfor %}";
        let special = SpecialTokens {
            bos: Some("<s>".into()),
            ..SpecialTokens::default()
        };
        let template = ChatTemplate::new(source, special).unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::User, "  a b ")],
            add_generation_prompt: false,
        };
        assert_eq!(template.render(0, &conversation).unwrap(), "<s>  a b|A B\n");
    }

    #[test]
    fn a_template_that_raises_names_the_conversation_and_its_words() {
        let source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}ok";
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::Assistant, "x")],
            add_generation_prompt: false,
        };
        let error = template.render(7, &conversation).unwrap_err().to_string();
        assert!(
            error.contains("conversation 7") && error.contains("roles must alternate"),
            "{error}"
        );
        let empty = Conversation {
            messages: Vec::new(),
            add_generation_prompt: false,
        };
        assert_eq!(
            template.render(2, &empty).unwrap_err(),
            ChatError::Empty { index: 2 }
        );
        let error = ChatTemplate::new("{% for m in messages %}", SpecialTokens::default())
            .unwrap_err()
            .to_string();
        assert!(error.contains("does not parse"), "{error}");
    }

    #[test]
    fn tojson_writes_what_pythons_json_dumps_writes() {
        let template = ChatTemplate::new(
            "{{ {'a': [1, 'é'], 'b': {'c': none}} | tojson }}|{{ [1] | tojson(indent=2) }}",
            SpecialTokens::default(),
        )
        .unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::User, "x")],
            add_generation_prompt: false,
        };
        assert_eq!(
            template.render(0, &conversation).unwrap(),
            "{\"a\": [1, \"é\"], \"b\": {\"c\": null}}|[\n  1\n]"
        );
    }

    #[test]
    fn a_tokenizer_config_gives_its_template_and_special_tokens_in_either_form() {
        let config = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}],
        });
        let (template, special) = from_tokenizer_config(&config);
        assert_eq!(template.as_deref(), Some("D"));
        assert_eq!(special.bos.as_deref(), Some("<s>"));
        assert_eq!(special.eos.as_deref(), Some("</s>"));
        assert_eq!(special.pad, None);
        let (template, _) = from_tokenizer_config(&serde_json::json!({"chat_template": "S"}));
        assert_eq!(template.as_deref(), Some("S"));
        assert_eq!(from_tokenizer_config(&serde_json::Value::Null).0, None);
    }

    #[test]
    fn bos_is_left_exactly_once() {
        let mut doubled = vec![1, 1, 5, 6];
        bos_once(&mut doubled, Some(1), true);
        assert_eq!(doubled, [1, 5, 6]);
        let mut missing = vec![5, 6];
        bos_once(&mut missing, Some(1), true);
        assert_eq!(missing, [1, 5, 6]);
        // A tokenizer that adds no BOS to text gets none added.
        let mut chatml = vec![5, 6];
        bos_once(&mut chatml, Some(1), false);
        assert_eq!(chatml, [5, 6]);
        let mut none = vec![5];
        bos_once(&mut none, None, true);
        assert_eq!(none, [5]);
    }

    #[test]
    fn conversations_read_with_their_roles_and_refuse_unknown_ones_and_fields() {
        let read: Conversation = serde_json::from_str(
            r#"{"messages": [{"role": "system", "content": "s"}, {"role": "tool", "content": "t"}]}"#,
        )
        .unwrap();
        assert_eq!(read.messages[1].role, Role::Tool);
        assert!(!read.add_generation_prompt);
        let error = serde_json::from_str::<Conversation>(
            r#"{"messages": [{"role": "narrator", "content": "s"}]}"#,
        )
        .unwrap_err()
        .to_string();
        assert!(error.contains("narrator"), "{error}");
        let error = serde_json::from_str::<Conversation>(r#"{"messages": [{"role": "user"}]}"#)
            .unwrap_err()
            .to_string();
        assert!(error.contains("content"), "{error}");
    }
}
