package frameworks_test

import (
	"os"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestDocsShowTheExamples: every Go block of docs/http.md's Frameworks
// section is in a tested example, line for line, so that the page cannot
// drift from wiring that runs.
func TestDocsShowTheExamples(t *testing.T) {
	doc, err := os.ReadFile("../../docs/http.md")
	require.NoError(t, err)
	_, section, ok := strings.Cut(string(doc), "\n## Frameworks\n")
	require.True(t, ok, "docs/http.md has no Frameworks section")
	section, _, _ = strings.Cut(section, "\n## ")

	var examples []string
	for _, f := range []string{"chi_example_test.go", "echo_example_test.go", "../../gin/example_test.go", "../../echo/example_test.go"} {
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		examples = append(examples, lines(string(src)))
	}
	blocks := 0
	for {
		var block string
		if _, section, ok = strings.Cut(section, "```go\n"); !ok {
			break
		}
		block, section, _ = strings.Cut(section, "```")
		blocks++
		found := false
		for _, e := range examples {
			found = found || strings.Contains(e, lines(block))
		}
		assert.True(t, found, "no example holds the block:\n%s", block)
	}
	assert.Equal(t, 5, blocks, "Go blocks in the section")
}

// lines is s with each line trimmed of its indentation, between newlines,
// so that a block matches whole lines only, however deep it is indented.
func lines(s string) string {
	ls := strings.Split(strings.TrimSpace(s), "\n")
	for i, l := range ls {
		ls[i] = strings.TrimSpace(l)
	}
	return "\n" + strings.Join(ls, "\n") + "\n"
}
