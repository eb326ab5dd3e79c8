package idempotency

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestReadmeQuickStartBuilds: the README's quick start is a complete main
// that compiles and passes go vet against this version of the library.
func TestReadmeQuickStartBuilds(t *testing.T) {
	if testing.Short() {
		t.Skip("builds a program")
	}
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	_, rest, ok := strings.Cut(string(readme), "## Quick start")
	require.True(t, ok, "README has no Quick start")
	_, rest, ok = strings.Cut(rest, "```go\n")
	require.True(t, ok, "Quick start has no Go block")
	src, _, ok := strings.Cut(rest, "```")
	require.True(t, ok)
	require.True(t, strings.HasPrefix(src, "package main\n"), "the quick start is a whole program")

	// Inside the module, so that it builds against this checkout.
	dir, err := os.MkdirTemp(".", "readme-quickstart-")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(dir) })
	require.NoError(t, os.WriteFile(filepath.Join(dir, "main.go"), []byte(src), 0o644))
	out, err := exec.Command("go", "vet", "./"+dir).CombinedOutput()
	require.NoError(t, err, "%s", out)
}
