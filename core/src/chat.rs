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

/// The role id of a token the template writes itself (markup: headers, separators, BOS):
/// `roles_i` holds it, or a message's [`Role::id`].
pub const TEMPLATE_ROLE: u8 = 0;

/// Each role id of `roles_i` and its name, as the manifest lists them.
pub const ROLE_NAMES: [(u8, &str); 5] = [
    (TEMPLATE_ROLE, "template"),
    (1, "system"),
    (2, "user"),
    (3, "assistant"),
    (4, "tool"),
];

impl Role {
    /// The role's id in `roles_i` (see [`ROLE_NAMES`]).
    pub fn id(self) -> u8 {
        match self {
            Self::System => 1,
            Self::User => 2,
            Self::Assistant => 3,
            Self::Tool => 4,
        }
    }

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

/// A run of a rendered conversation's bytes with one role and turn: a message's content (its
/// role, its index), or markup the template writes around message `turn` (the template's role;
/// the generation prompt's turn is the message count).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Span {
    /// The bytes, in the rendered text.
    pub bytes: std::ops::Range<usize>,
    /// [`TEMPLATE_ROLE`] or a message's [`Role::id`].
    pub role: u8,
    /// The message it belongs to, from 0.
    pub turn: u16,
}

impl ChatTemplate {
    /// Renders conversation `index` and finds which bytes are which message's: the text is
    /// rendered message by message (the first message, the first two, ...), each rendering a
    /// prefix of the next, so message `i`'s part of the text is what its rendering adds; inside
    /// that part, its content (as written, or trimmed where the template trims it) is its
    /// role's and the rest the template's. A template whose renderings are not prefixes of each
    /// other (it rewrites earlier turns as later ones come) is an error naming the turn.
    pub fn spans(
        &self,
        index: usize,
        conversation: &Conversation,
    ) -> Result<(String, Vec<Span>), ChatError> {
        let text = self.render(index, conversation)?;
        let messages = &conversation.messages;
        let mut spans = Vec::with_capacity(2 * messages.len() + 1);
        let mut start = 0;
        for (turn, message) in messages.iter().enumerate() {
            let last = turn + 1 == messages.len();
            let prefix = self.render_messages(
                index,
                &messages[..=turn],
                last && conversation.add_generation_prompt,
            )?;
            let end = if last { text.len() } else { prefix.len() };
            if !text.starts_with(&prefix) || end < start {
                return Err(ChatError::Render {
                    index,
                    reason: format!(
                        "the template renders message {turn} differently once later messages follow, so its tokens' roles cannot be told apart"
                    ),
                });
            }
            let turn_id = u16::try_from(turn).unwrap_or(u16::MAX);
            let part = &text[start..end];
            let content = [message.content.as_str(), message.content.trim()]
                .into_iter()
                .filter(|c| !c.is_empty())
                .find_map(|c| part.find(c).map(|at| (start + at, start + at + c.len())));
            match content {
                Some((from, to)) => {
                    spans.push(markup(start..from, turn_id));
                    spans.push(Span {
                        bytes: from..to,
                        role: message.role.id(),
                        turn: turn_id,
                    });
                    spans.push(markup(to..end, turn_id));
                }
                None => spans.push(markup(start..end, turn_id)),
            }
            start = end;
        }
        if conversation.add_generation_prompt {
            // The generation prompt is what the last rendering added past its message's part.
            let generation = self.render_messages(index, messages, false)?;
            if let Some(last) = spans.iter_mut().rev().find(|s| s.role == TEMPLATE_ROLE)
                && text.starts_with(&generation)
                && last.bytes.end == text.len()
                && last.bytes.start <= generation.len()
            {
                last.bytes.end = generation.len();
                spans.push(markup(
                    generation.len()..text.len(),
                    u16::try_from(messages.len()).unwrap_or(u16::MAX),
                ));
            }
        }
        spans.retain(|s| !s.bytes.is_empty());
        Ok((text, spans))
    }
}

/// Markup of turn `turn` over `bytes`.
fn markup(bytes: std::ops::Range<usize>, turn: u16) -> Span {
    Span {
        bytes,
        role: TEMPLATE_ROLE,
        turn,
    }
}

/// Each token's role and turn, from its byte offsets in the rendered text: a token with any
/// byte of a message's content is that message's (a word's leading space, or a newline merged
/// into its last word, does not make it markup), any other the template's, of the turn its
/// first byte falls in. A token the tokenizer adds outside the text (an empty span such as
/// `(0, 0)`) is the template's, turn 0.
pub fn token_roles(offsets: &[(usize, usize)], spans: &[Span]) -> (Vec<u8>, Vec<u16>) {
    offsets
        .iter()
        .map(|&(from, to)| {
            if to <= from {
                return (TEMPLATE_ROLE, 0);
            }
            let content = spans
                .iter()
                .find(|s| s.role != TEMPLATE_ROLE && s.bytes.start < to && from < s.bytes.end);
            content
                .or_else(|| spans.iter().find(|s| s.bytes.contains(&from)))
                .map_or((TEMPLATE_ROLE, 0), |s| (s.role, s.turn))
        })
        .unzip()
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
/// would add one to plain text (`adds_bos`) but the template wrote none, one is added. What it
/// did is returned, so per-token columns can follow ([`BosFix::apply`]).
pub fn bos_once(ids: &mut Vec<u32>, bos: Option<u32>, adds_bos: bool) -> BosFix {
    let Some(bos) = bos else {
        return BosFix::Unchanged;
    };
    let leading = ids.iter().take_while(|&&id| id == bos).count();
    if leading > 1 {
        ids.drain(..leading - 1);
        BosFix::Removed(leading - 1)
    } else if leading == 0 && adds_bos {
        ids.insert(0, bos);
        BosFix::Added
    } else {
        BosFix::Unchanged
    }
}

/// What [`bos_once`] did to a conversation's ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum BosFix {
    /// Nothing.
    Unchanged,
    /// Removed this many leading tokens (extra BOS).
    Removed(usize),
    /// Put a BOS in front.
    Added,
}

impl BosFix {
    /// Does the same to a per-token column: drops its first tokens, or puts `added` in front.
    pub fn apply<T: Copy>(self, column: &mut Vec<T>, added: T) {
        match self {
            Self::Unchanged => {}
            Self::Removed(n) => {
                column.drain(..n.min(column.len()));
            }
            Self::Added => column.insert(0, added),
        }
    }
}

/// Each token of a conversation: its role id ([`ROLE_NAMES`]) and its turn (the message it
/// belongs to, from 0; the generation prompt's is the message count), beside its id.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TokenRoles {
    /// Role id per token.
    pub roles: Vec<u8>,
    /// Turn per token.
    pub turns: Vec<u16>,
}

impl TokenRoles {
    /// Keeps the first `n` tokens' roles, as the context window keeps the first `n` ids.
    pub fn truncate(&mut self, n: usize) {
        self.roles.truncate(n);
        self.turns.truncate(n);
    }
}

/// A rendered conversation's token ids (tokenized without special tokens, with each token's
/// byte `offsets` in the rendered text) as they run, one BOS at the start, with each token's
/// role and turn from the conversation's `spans` ([`ChatTemplate::spans`]). A BOS put in front
/// is the template's, turn 0.
pub fn conversation_tokens(
    mut ids: Vec<u32>,
    offsets: &[(usize, usize)],
    spans: &[Span],
    (bos, adds_bos): (Option<u32>, bool),
) -> (Vec<u32>, TokenRoles) {
    let (mut roles, mut turns) = token_roles(offsets, spans);
    let fix = bos_once(&mut ids, bos, adds_bos);
    fix.apply(&mut roles, TEMPLATE_ROLE);
    fix.apply(&mut turns, 0);
    (ids, TokenRoles { roles, turns })
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
    fn each_byte_of_a_rendered_conversation_is_a_message_s_content_or_markup_of_its_turn() {
        let template = ChatTemplate::new(CHATML, SpecialTokens::default()).unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::User, "Hi"), said(Role::Assistant, "Hello")],
            add_generation_prompt: true,
        };
        let (text, spans) = template.spans(0, &conversation).unwrap();
        let pieces: Vec<(&str, u8, u16)> = spans
            .iter()
            .map(|s| (&text[s.bytes.clone()], s.role, s.turn))
            .collect();
        assert_eq!(
            pieces,
            [
                (
                    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n",
                    TEMPLATE_ROLE,
                    0
                ),
                ("Hi", Role::User.id(), 0),
                // A message's closing markup is its turn's; the next one's opening, the next.
                ("<|im_end|>\n", TEMPLATE_ROLE, 0),
                ("<|im_start|>assistant\n", TEMPLATE_ROLE, 1),
                ("Hello", Role::Assistant.id(), 1),
                ("<|im_end|>\n", TEMPLATE_ROLE, 1),
                ("<|im_start|>assistant\n", TEMPLATE_ROLE, 2),
            ]
        );
        // The spans cover the text once, in order.
        assert_eq!(spans.first().unwrap().bytes.start, 0);
        assert_eq!(spans.last().unwrap().bytes.end, text.len());
        assert!(spans.windows(2).all(|w| w[0].bytes.end == w[1].bytes.start));
    }

    #[test]
    fn a_trimmed_content_is_still_its_role_s_and_a_token_with_any_content_byte_is_the_message_s() {
        let source =
            "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] | trim }}\n{% endfor %}";
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::System, "  be brief  "), said(Role::User, "ok")],
            add_generation_prompt: false,
        };
        let (text, spans) = template.spans(0, &conversation).unwrap();
        assert_eq!(text, "[system] be brief\n[user] ok\n");
        let content: Vec<&str> = spans
            .iter()
            .filter(|s| s.role != TEMPLATE_ROLE)
            .map(|s| &text[s.bytes.clone()])
            .collect();
        assert_eq!(content, ["be brief", "ok"]);
        // Tokens: "[system]", " be", " brief", "\n[user]", " ok", and an added BOS (0, 0).
        let offsets = [(0, 8), (8, 11), (11, 17), (17, 24), (24, 27), (0, 0)];
        let (roles, turns) = token_roles(&offsets, &spans);
        assert_eq!(
            roles,
            [
                0,
                Role::System.id(),
                Role::System.id(),
                0,
                Role::User.id(),
                0
            ]
        );
        assert_eq!(turns, [0, 0, 0, 0, 1, 0]);
    }

    #[test]
    fn a_template_that_rewrites_earlier_turns_is_refused_naming_the_turn() {
        // The first message renders differently once it is not the last.
        let source = "{% for m in messages %}{% if loop.last %}LAST {% endif %}{{ m['content'] }};{% endfor %}";
        let template = ChatTemplate::new(source, SpecialTokens::default()).unwrap();
        let conversation = Conversation {
            messages: vec![said(Role::User, "a"), said(Role::Assistant, "b")],
            add_generation_prompt: false,
        };
        let error = template.spans(3, &conversation).unwrap_err().to_string();
        assert!(
            error.contains("conversation 3") && error.contains("message 0"),
            "{error}"
        );
    }

    #[test]
    fn bos_is_left_exactly_once() {
        let mut doubled = vec![1, 1, 5, 6];
        assert_eq!(bos_once(&mut doubled, Some(1), true), BosFix::Removed(1));
        assert_eq!(doubled, [1, 5, 6]);
        let mut missing = vec![5, 6];
        assert_eq!(bos_once(&mut missing, Some(1), true), BosFix::Added);
        assert_eq!(missing, [1, 5, 6]);
        // A tokenizer that adds no BOS to text gets none added.
        let mut chatml = vec![5, 6];
        assert_eq!(bos_once(&mut chatml, Some(1), false), BosFix::Unchanged);
        assert_eq!(chatml, [5, 6]);
        let mut none = vec![5];
        assert_eq!(bos_once(&mut none, None, true), BosFix::Unchanged);
        assert_eq!(none, [5]);
    }

    #[test]
    fn a_conversations_roles_follow_its_bos_fix_token_for_token() {
        let spans = [
            markup(0..3, 0),
            Span {
                bytes: 3..8,
                role: Role::User.id(),
                turn: 0,
            },
        ];
        // Two BOS (the template's and the tokenizer's), then "hey" and "there".
        let offsets = [(0, 0), (0, 3), (3, 5), (5, 8)];
        let (ids, roles) = conversation_tokens(vec![1, 1, 7, 8], &offsets, &spans, (Some(1), true));
        assert_eq!(ids, [1, 7, 8]);
        assert_eq!(roles.roles, [TEMPLATE_ROLE, 2, 2]);
        assert_eq!(roles.turns, [0, 0, 0]);
        let (ids, roles) = conversation_tokens(vec![7, 8], &offsets[2..], &spans, (Some(1), true));
        assert_eq!(ids, [1, 7, 8]);
        assert_eq!(roles.roles, [TEMPLATE_ROLE, 2, 2]);
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
