//! Chat templates from `tokenizer_config.json`, rendered with minijinja as
//! transformers' `apply_chat_template` does.

use super::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    #[error("chat template: {0}")]
    Render(String),
}

pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// `None` when the model has no template.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Result<Option<Self>, TemplateError> {
        let Some(source) = tokenizer.chat_template.clone() else { return Ok(None) };
        let mut env = minijinja::Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source).map_err(|e| TemplateError::Render(e.to_string()))?;
        Ok(Some(Self {
            env,
            bos_token: tokenizer.bos_token.clone().unwrap_or_default(),
            eos_token: tokenizer.eos_token.clone().unwrap_or_default(),
        }))
    }

    pub fn render(&self, messages: &[serde_json::Value], add_generation_prompt: bool) -> Result<String, TemplateError> {
        let template = self.env.get_template("chat").map_err(|e| TemplateError::Render(e.to_string()))?;
        template
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| TemplateError::Render(e.to_string()))
    }
}
