// NVIDIA's NRI plugin (from nvidia-container-toolkit's nvidia-ctk-installer, which the GPU Operator
// 25.10+ runs with cdi.nriPluginEnabled) on its own, without the installer's host set-up: for the local
// cluster's real nodes. It injects the CDI devices a pod's nvidia.cdi.k8s.io annotations name.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/NVIDIA/nvidia-container-toolkit/cmd/nvidia-ctk-installer/container/runtime/nri"
)

// logger is the toolkit's logger.Interface (an internal package, so matched by its methods).
type logger struct{}

func (logger) Debugf(f string, a ...interface{})   { log.Printf("debug: "+f, a...) }
func (logger) Errorf(f string, a ...interface{})   { log.Printf("error: "+f, a...) }
func (logger) Infof(f string, a ...interface{})    { log.Printf("info: "+f, a...) }
func (logger) Warningf(f string, a ...interface{}) { log.Printf("warning: "+f, a...) }
func (logger) Tracef(string, ...interface{})       {}

func main() {
	socket := flag.String("nri-socket", "/var/run/nri/nri.sock", "containerd's NRI socket")
	index := flag.Uint("nri-plugin-index", 10, "the plugin's NRI index (as the installer's default)")
	namespace := flag.String("nri-namespace", "gpu-operator", "namespace allowed management CDI devices")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	plugin := nri.NewPlugin(ctx, logger{}, []string{*namespace})
	if err := plugin.Start(ctx, *socket, fmt.Sprintf("%02d", *index)); err != nil {
		log.Printf("error: %v", err)
		os.Exit(1)
	}
	log.Printf("info: NRI plugin registered on %s", *socket)
	<-ctx.Done()
	plugin.Stop()
}
