package main

import (
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	var out strings.Builder
	if err := run(&out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"worker 2 rank 0, 32 tokens cached",
		"again: KVR_ALREADY_EXISTS",
		"ingest: 1 message, 1 event applied",
		"now worker 4, 48 tokens cached",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
}
