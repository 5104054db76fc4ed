package picker

import (
	"encoding/json"
	"errors"
	"fmt"
)

// completion is the part of an OpenAI-style completion request the picker reads.
type completion struct {
	Model          string          `json:"model"`
	Prompt         json.RawMessage `json:"prompt"`
	PromptTokenIDs json.RawMessage `json:"prompt_token_ids"`
}

// parseCompletion returns the prompt's token ids and the model of a completion body. The ids
// are `prompt_token_ids`, or `prompt` when it is a list of ids or a list holding one list of
// ids (the batch form with a batch of one). Text prompts are refused: kvrouter routes on
// tokens, and tokenising is the gateway's or the engine's job, not the picker's.
func parseCompletion(body []byte) (tokens []uint32, model string, err error) {
	var c completion
	if err := json.Unmarshal(body, &c); err != nil {
		return nil, "", fmt.Errorf("the body is not a JSON object: %w", err)
	}
	switch {
	case len(c.PromptTokenIDs) > 0 && string(c.PromptTokenIDs) != "null":
		tokens, err = tokenList(c.PromptTokenIDs, "prompt_token_ids")
	case len(c.Prompt) > 0 && string(c.Prompt) != "null":
		tokens, err = promptTokens(c.Prompt)
	default:
		err = errors.New("the body has no prompt_token_ids and no prompt")
	}
	if err != nil {
		return nil, "", err
	}
	return tokens, c.Model, nil
}

// promptTokens reads `prompt` as [ids...] or [[ids...]].
func promptTokens(raw json.RawMessage) ([]uint32, error) {
	var batch [][]uint32
	if json.Unmarshal(raw, &batch) == nil && len(batch) > 0 {
		if len(batch) != 1 {
			return nil, fmt.Errorf("prompt holds %d prompts; the picker routes one request, send one prompt", len(batch))
		}
		return nonEmpty(batch[0], "prompt")
	}
	return tokenList(raw, "prompt")
}

func tokenList(raw json.RawMessage, field string) ([]uint32, error) {
	var tokens []uint32
	if err := json.Unmarshal(raw, &tokens); err != nil {
		return nil, fmt.Errorf("%s is not a list of token ids (integers 0..2^32-1): %w", field, err)
	}
	return nonEmpty(tokens, field)
}

func nonEmpty(tokens []uint32, field string) ([]uint32, error) {
	if len(tokens) == 0 {
		return nil, fmt.Errorf("%s is an empty list of token ids", field)
	}
	return tokens, nil
}
