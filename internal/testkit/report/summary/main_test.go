package main

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/idempotency-go/idempotency/internal/testkit/report"
)

func TestSummarize(t *testing.T) {
	in := `{"suite":"faults","store":"redis","case":"A","faults":{"reset":3},"operations":10,"duplicates":4}
{"suite":"faults","store":"redis","case":"B","faults":{"reset":2,"latency":1},"operations":5}
{"suite":"linearizable","store":"postgres","linearizable":"Ok","operations":100}
{"suite":"hostile","store":"redis","peak_heap":2097152}
{"suite":"fuzz","case":"FuzzA","fuzz_execs":1000}
{"suite":"fuzz","case":"FuzzB","fuzz_execs":500}
`
	entries, err := read(strings.NewReader(in))
	require.NoError(t, err)
	var out strings.Builder
	assert.True(t, summarize(&out, entries))
	s := out.String()
	assert.Contains(t, s, "faults latency 1, reset 5")
	assert.Regexp(t, `faults\s+redis\s+2\s+15\s+4\s+0\s+0\s+0`, s)
	assert.Contains(t, s, "linearizable Ok 1")
	assert.Contains(t, s, "peak heap 2.0 MiB")
	assert.Contains(t, s, "fuzz: 2 targets, 1500 executions")
	assert.Contains(t, s, "PASS: 0 double executions")
}

func TestSummarizeFails(t *testing.T) {
	for name, line := range map[string]string{
		"double":        `{"suite":"soak","store":"redis","double_executions":1}`,
		"lost":          `{"suite":"restarts","store":"redis","lost_completions":2}`,
		"stranded":      `{"suite":"faults","store":"postgres","stranded_waiters":1}`,
		"illegal":       `{"suite":"linearizable","store":"redis","linearizable":"Illegal"}`,
		"check timeout": `{"suite":"linearizable","store":"redis","linearizable":"Unknown"}`,
	} {
		t.Run(name, func(t *testing.T) {
			entries, err := read(strings.NewReader(line + "\n"))
			require.NoError(t, err)
			var out strings.Builder
			assert.False(t, summarize(&out, entries))
			assert.Contains(t, out.String(), "FAIL:")
		})
	}
}

func TestReadRejectsGarbage(t *testing.T) {
	_, err := read(strings.NewReader("{\"suite\":\"x\"}\nnot json\n"))
	assert.ErrorContains(t, err, "line 2")
}

func TestAbsent(t *testing.T) {
	entries := []report.Entry{{Suite: "faults"}, {Suite: "fuzz"}, {Suite: "faults", Server: "valkey-server"}}
	assert.Equal(t, []string{"soak", "restarts"}, absent(entries, "faults,soak,fuzz,restarts"))
	assert.Empty(t, absent(entries, "fuzz,faults,faults@valkey-server"))
	assert.Equal(t, []string{"fuzz@valkey-server"}, absent(entries, "fuzz@valkey-server"))
	assert.Empty(t, absent(entries, ""))
}

// A Redis store's entries from another server are a line of their own,
// which a failure on it fails like any other.
func TestSummarizeByServer(t *testing.T) {
	in := `{"suite":"restarts","store":"redis","operations":10}
{"suite":"restarts","store":"redis","server":"valkey-server","operations":7,"notes":"n"}
{"suite":"restarts","store":"redis-cluster","server":"valkey-server","operations":5}
`
	entries, err := read(strings.NewReader(in))
	require.NoError(t, err)
	var out strings.Builder
	assert.True(t, summarize(&out, entries))
	s := out.String()
	assert.Regexp(t, `restarts\s+redis\s+1\s+10\s`, s)
	assert.Regexp(t, `restarts\s+redis \(valkey-server\)\s+1\s+7\s`, s)
	assert.Regexp(t, `restarts\s+redis-cluster \(valkey-server\)\s+1\s+5\s`, s)
	assert.Contains(t, s, "note: restarts/redis (valkey-server) : n")

	entries, err = read(strings.NewReader(`{"suite":"restarts","store":"redis","server":"valkey-server","lost_completions":1}` + "\n"))
	require.NoError(t, err)
	out.Reset()
	assert.False(t, summarize(&out, entries))
}
