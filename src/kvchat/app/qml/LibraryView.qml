// The model library: one card per model on this computer, the loaded one first, with what it is
// and the planner's badge for this machine (its contexts per KV precision in the badge's tooltip).
import QtQuick
import QtQuick.Controls
import QtQuick.Layouts

Rectangle {
    id: root
    color: theme.colours.bg
    // the controls' colours: the application's palette does not reach a QQuickWidget's window, so
    // the buttons and the text field stayed light in the dark theme
    palette.window: theme.colours.bg
    palette.windowText: theme.colours.text
    palette.base: theme.colours.panel
    palette.text: theme.colours.text
    palette.button: theme.colours.chip
    palette.buttonText: theme.colours.text
    palette.highlight: theme.colours.accent
    palette.highlightedText: theme.colours.accentText
    palette.placeholderText: theme.colours.muted
    palette.mid: theme.colours.border
    palette.disabled.buttonText: theme.colours.muted
    palette.disabled.text: theme.colours.muted
    readonly property var badgeColours: ({"fits": theme.colours.warm, "kv": theme.colours.accent,
                                          "weights": "#b45309", "too-large": theme.colours.danger,
                                          "unknown": theme.colours.muted})

    ColumnLayout {
        anchors.fill: parent
        anchors.margins: 20
        spacing: 12

        Text {
            text: "Models on this computer"
            color: theme.colours.text
            font.pixelSize: 20
            font.bold: true
        }
        Text {
            objectName: "libraryStatus"
            Layout.fillWidth: true
            text: library.status
            color: theme.colours.muted
            font.pixelSize: 13
            wrapMode: Text.Wrap
        }

        ListView {
            id: list
            objectName: "models"
            Layout.fillWidth: true
            Layout.fillHeight: true
            clip: true
            spacing: 8
            model: libraryModel
            ScrollBar.vertical: ScrollBar { policy: ScrollBar.AsNeeded }
            delegate: Rectangle {
                id: card
                required property string name
                required property string details
                required property string source
                required property string path
                required property string kind
                required property string badge
                required property string tip
                required property bool loaded
                objectName: "modelCard"
                property string modelName: name
                property string modelPath: path
                width: ListView.view.width - 12
                height: body.implicitHeight + 24
                radius: 12
                color: cardHover.hovered ? theme.colours.hover : theme.colours.panel
                border.color: loaded ? theme.colours.accent : theme.colours.border
                HoverHandler { id: cardHover }

                RowLayout {
                    id: body
                    anchors.fill: parent
                    anchors.margins: 12
                    spacing: 12
                    ColumnLayout {
                        Layout.fillWidth: true
                        spacing: 4
                        RowLayout {
                            spacing: 8
                            Text {
                                objectName: "modelName"
                                text: card.name
                                color: theme.colours.text
                                font.pixelSize: 15
                                font.bold: true
                                elide: Text.ElideRight
                                Layout.maximumWidth: card.width - 340
                            }
                            Rectangle {
                                visible: card.loaded
                                objectName: "loadedTag"
                                radius: 8
                                color: theme.colours.accent
                                implicitWidth: loadedText.implicitWidth + 14
                                implicitHeight: loadedText.implicitHeight + 4
                                Text { id: loadedText; anchors.centerIn: parent; text: "loaded"; color: theme.colours.accentText; font.pixelSize: 11 }
                            }
                        }
                        Text {
                            objectName: "modelDetails"
                            text: card.details
                            color: theme.colours.text
                            font.pixelSize: 13
                            Layout.fillWidth: true
                            wrapMode: Text.Wrap
                        }
                        Text {
                            text: card.source + " · " + card.path
                            color: theme.colours.muted
                            font.pixelSize: 11
                            Layout.fillWidth: true
                            elide: Text.ElideMiddle
                        }
                    }
                    Rectangle {
                        id: badgeBox
                        objectName: "fitBadge"
                        property string label: card.badge
                        property string kind: card.kind
                        property string tip: card.tip
                        radius: 11
                        color: "transparent"
                        border.color: root.badgeColours[card.kind] || theme.colours.muted
                        implicitWidth: badgeText.implicitWidth + 20
                        implicitHeight: 24
                        Text {
                            id: badgeText
                            anchors.centerIn: parent
                            text: card.badge
                            color: root.badgeColours[card.kind] || theme.colours.muted
                            font.pixelSize: 12
                            font.bold: true
                        }
                        HoverHandler { id: badgeHover }
                        ToolTip.visible: badgeHover.hovered
                        ToolTip.text: card.tip
                        ToolTip.delay: 200
                    }
                    Button {
                        objectName: "loadModel"
                        text: card.loaded ? "Loaded" : "Load"
                        enabled: !card.loaded && card.kind !== "too-large"
                        onClicked: library.load(card.path)
                    }
                }
            }
        }

        RowLayout {
            Layout.fillWidth: true
            spacing: 8
            TextField {
                id: hubId
                objectName: "hubId"
                Layout.fillWidth: true
                enabled: !library.isDownloading
                placeholderText: "Download from Hugging Face: org/name"
                onAccepted: library.download(text)
            }
            Button {
                objectName: "download"
                text: "Download"
                visible: !library.isDownloading
                onClicked: library.download(hubId.text)
            }
            ProgressBar {
                objectName: "downloadBar"
                visible: library.isDownloading
                Layout.preferredWidth: 200
                indeterminate: library.progress < 0
                value: Math.max(0, library.progress)
            }
            Text {
                visible: library.isDownloading
                text: library.progressText
                color: theme.colours.muted
                font.pixelSize: 12
            }
            Button {
                objectName: "cancelDownload"
                text: "Cancel download"
                visible: library.isDownloading
                onClicked: library.cancelDownload()
            }
        }
        RowLayout {
            Layout.fillWidth: true
            Button { objectName: "addFolder"; text: "Add folder…"; onClicked: library.addFolder() }
            Button { objectName: "openGguf"; text: "Open .gguf…"; onClicked: library.openFile() }
            Item { Layout.fillWidth: true }
            Button { objectName: "closeLibrary"; text: "Close"; onClicked: library.close() }
        }
    }
}
