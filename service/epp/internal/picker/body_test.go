package picker

import (
	"slices"
	"testing"
)

func TestParseCompletionForms(t *testing.T) {
	for _, tc := range []struct {
		body  string
		want  []uint32
		model string
	}{
		{`{"model": "m", "prompt": [1, 2, 3]}`, []uint32{1, 2, 3}, "m"},
		{`{"prompt": [[4, 5]]}`, []uint32{4, 5}, ""},
		{`{"prompt_token_ids": [6], "prompt": "text is ignored then"}`, []uint32{6}, ""},
		{`{"prompt": null, "prompt_token_ids": [4294967295]}`, []uint32{4294967295}, ""},
	} {
		tokens, model, err := parseCompletion([]byte(tc.body))
		if err != nil || !slices.Equal(tokens, tc.want) || model != tc.model {
			t.Errorf("parseCompletion(%s) = %v, %q, %v; want %v, %q", tc.body, tokens, model, err, tc.want, tc.model)
		}
	}
	if _, _, err := parseCompletion([]byte(`{"prompt": [4294967296]}`)); err == nil {
		t.Error("a token id above 2^32-1 was accepted")
	}
}
