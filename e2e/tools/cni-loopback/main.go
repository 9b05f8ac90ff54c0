// Command cni-loopback completes a CNI chain by reporting 127.0.0.1/8 as the pod's IP. containerd's
// CRI takes the pod IP from the result's interface named eth0 (internal/cri/server/sandbox_run.go)
// and refuses a sandbox without one, so the address is reported under that name; the pod's network
// namespace really has only lo, brought up by the loopback plugin before this one.
package main

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
)

func main() {
	switch os.Getenv("CNI_COMMAND") {
	case "VERSION":
		fmt.Print(`{"cniVersion":"1.0.0","supportedVersions":["0.4.0","1.0.0","1.1.0"]}`)
	case "ADD":
		raw, err := io.ReadAll(os.Stdin)
		if err != nil {
			fail(err)
		}
		var conf struct {
			CNIVersion string `json:"cniVersion"`
		}
		if err := json.Unmarshal(raw, &conf); err != nil {
			fail(err)
		}
		result := map[string]any{
			"cniVersion": conf.CNIVersion,
			"interfaces": []map[string]any{{"name": "eth0", "sandbox": os.Getenv("CNI_NETNS")}},
			"ips":        []map[string]any{{"address": "127.0.0.1/8", "interface": 0}},
		}
		if err := json.NewEncoder(os.Stdout).Encode(result); err != nil {
			fail(err)
		}
	default: // DEL, CHECK, GC, STATUS: nothing to undo or check
	}
}

func fail(err error) {
	fmt.Fprintf(os.Stdout, `{"cniVersion":"1.0.0","code":999,"msg":%q}`, err.Error())
	os.Exit(1)
}
