package main

import (
	"bytes"
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

func TestHelpDocumentsEveryFlag(t *testing.T) {
	var out bytes.Buffer
	if _, err := parseFlags([]string{"--help"}, &out); !errors.Is(err, flag.ErrHelp) {
		t.Fatalf("--help: err = %v, want flag.ErrHelp", err)
	}
	for _, name := range []string{"listen", "kvrouterd", "max-body-bytes", "route-timeout", "health-listen",
		"call-timeout", "workers-ttl", "model-as-lora", "drain-timeout", "log-level"} {
		if !strings.Contains(out.String(), "  -"+name+" ") && !strings.Contains(out.String(), "  -"+name+"\n") {
			t.Errorf("--help does not document --%s:\n%s", name, out.String())
		}
	}
}

func TestFlags(t *testing.T) {
	o, err := parseFlags(nil, &bytes.Buffer{})
	if err != nil || o.listen != "127.0.0.1:9002" || o.kvrouterd != "http://127.0.0.1:8080" {
		t.Fatalf("defaults: %+v, %v", o, err)
	}
	o, err = parseFlags([]string{"--route-timeout=250ms", "--max-body-bytes=1024", "--model-as-lora"}, &bytes.Buffer{})
	if err != nil || o.picker.RouteTimeout != 250*time.Millisecond || o.picker.MaxBodyBytes != 1024 || !o.picker.ModelAsLora {
		t.Fatalf("parsed: %+v, %v", o, err)
	}
	for _, bad := range []string{"--max-body-bytes=0", "--kvrouterd=127.0.0.1:8080", "--kvrouterd=http://"} {
		if _, err := parseFlags([]string{bad}, &bytes.Buffer{}); err == nil {
			t.Errorf("%s accepted", bad)
		}
	}
}
